"""python -m esopt_mp.envs (list, check) as a user runs it."""
import json
import subprocess
import sys

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
