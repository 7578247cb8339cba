"""python -m esopt_mp.envs (list, check) as a user runs it."""
import json
import subprocess
import sys

import pytest

from esopt_mp.envs import registry


def test_a_plugin_with_a_builtins_name_is_listed_as_shadowed(tmp_path, monkeypatch):
    info = tmp_path / "shadow_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: shadow-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[esopt_mp.envs]\nsudoku = shadow_mod:Env\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert registry.shadowed() == {"sudoku": "shadow_mod:Env"} and "sudoku" not in registry.names()[1]
    out = subprocess.run([sys.executable, "-m", "esopt_mp.envs", "list"], capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, check=True)
    assert json.loads(out.stdout)["shadowed"] == {"sudoku": "shadow_mod:Env"}


def test_check_reports_bad_values_startup_and_task_failures(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "esopt_mp.envs", "check", *args], capture_output=True,
                              text=True, timeout=300)

    p = run("sudoku", "size={4")
    assert p.returncode == 2 and p.stderr.strip().startswith("error: size: not a YAML value"), p.stderr
    p = run("sudoku", "size=9", "mask_count=2", "--reply", "set 1 1 1", "--max-turns", "1")
    out = json.loads(p.stdout)
    assert p.returncode == 0 and out["section"]["size"] == 9 and len(out["tasks"]["eval"]) == 2
    p = run("math_react", "--n-train", "2", "--n-eval", "0")
    assert p.returncode == 1 and json.loads(p.stdout)["failure"]["at"] == "tasks"


def _dist(root, dist: str, entry: str, module: str, src: str) -> str:
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[esopt_mp.envs]\n{entry}\n")
    (root / f"{module}.py").write_text(src)
    return str(root)


PLAY = '''
class Env:
    TAG = {tag!r}

    @classmethod
    def tasks(cls, split, n, seed):
        if cls.TAG == "down":
            raise ConnectionError("the task server is down")
        return [{{"id": f"{{cls.TAG}}-{{split}}{{i}}"}} for i in range(n)]

    def __init__(self, max_turns=2):
        if self.TAG == "unbuilt":
            raise RuntimeError("no board")

    def reset(self, task):
        return [{{"role": "user", "content": self.TAG}}], {{}}

    def step(self, text):
        return [], 1.0, True, False, {{}}
'''


def _cli(*args, path: list[str]):
    return subprocess.run([sys.executable, "-m", "esopt_mp.envs", *args], capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": ":".join(path), "PATH": "/usr/bin:/bin"})


def test_two_distributions_with_one_name_are_listed_and_checked_with_one_warning_line(tmp_path):
    path = [_dist(tmp_path / t, f"{t}-plugin", f"twin = twin_{t}:Env", f"twin_{t}", PLAY.format(tag=t))
            for t in ("alpha", "beta")]
    listed = json.loads(_cli("list", path=path).stdout)
    assert listed["plugins"] == ["twin"] and [d["distribution"] for d in listed["duplicates"]["twin"]] == \
        ["alpha-plugin", "beta-plugin"]
    for order in (path, path[::-1]):
        p = _cli("check", "twin", "--reply", "x", path=order)
        used, other = ("alpha", "beta") if order == path else ("beta", "alpha")
        assert p.returncode == 0 and json.loads(p.stdout)["opening"][0]["content"] == used
        assert p.stderr.splitlines() == [
            f"environment 'twin' is declared by 2 installed distributions, {used}-plugin (twin_{used}:Env), "
            f"{other}-plugin (twin_{other}:Env): using {used}-plugin's, the first on sys.path; to use another, "
            f"uninstall {used}-plugin or give an entry point another name"]


def test_check_reports_a_plugins_failing_tasks_and_constructor_naming_it(tmp_path):
    for tag, at, error in (("down", "tasks", "ValueError: environment 'down': tasks('train', 2, 0) of plugin "
                                            "down_mod:Env (distribution down-plugin) raised ConnectionError: the "
                                            "task server is down"),
                           ("unbuilt", "build", "RuntimeError: no board")):
        p = _cli("check", tag, path=[_dist(tmp_path / tag, f"{tag}-plugin", f"{tag} = {tag}_mod:Env", f"{tag}_mod",
                                           PLAY.format(tag=tag))])
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
        assert json.loads(p.stdout)["failure"] == {"kind": "startup", "at": at, "error": error}


def test_check_plays_a_gymnasium_episode_to_its_last_turn_and_no_further():
    pytest.importorskip("gymnasium")
    p = subprocess.run([sys.executable, "-m", "esopt_mp.envs", "check", "gymnasium", "kwargs.is_slippery=false",
                        "--reply", "<action>left</action>", "--max-turns", "4"], capture_output=True, text=True,
                       timeout=300)
    out = json.loads(p.stdout)
    assert p.returncode == 0 and out["turns"] == 4 and "Turn 1/4. Your action:" in out["opening"][-1]["content"]
    assert out["feedback"].endswith("\nOut of turns (4/4): the episode is over.") and "Turn 5" not in out["feedback"]
