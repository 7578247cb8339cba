"""A user's own environment as a plugin: the example package pip-installed into this environment and trained on,
as a user would (subprocesses of launch/train.py), and plugins that are broken in the ways plugins break."""
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "esopt_env_example")
SHORT = ["es.population=2", "es.steps=2", "env.n_train=8", "env.n_eval=2", "env.episodes_per_step=2",
         "env.max_turns=3", "run.eval_every=0", "run.checkpoint_every=0", "engine.max_new_tokens=8"]


def _pip(*args):
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def example_installed(tmp_path_factory):
    """``pip install`` of examples/esopt_env_example into the running interpreter's environment, removed after
    (built from a copy: setuptools' build/ and egg-info stay out of the source tree, and nothing stale is reused)."""
    import shutil

    src = tmp_path_factory.mktemp("example") / "esopt_env_example"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    offline = ["--no-build-isolation"] if _has("setuptools") else []  # else pip fetches setuptools to build it
    p = _pip("install", "--no-deps", *offline, str(src))
    if p.returncode:
        pytest.fail(f"pip install of the example failed: {p.stderr[-2000:]}")
    try:
        yield
    finally:
        _pip("uninstall", "-y", "esopt-env-example")


def _has(mod: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(mod) is not None


def _train(run_dir, *overrides, env=None):
    return subprocess.run([sys.executable, "launch/train.py", *SHORT, *overrides, f"run.dir={run_dir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {})))


def _history(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "history.jsonl"))]


def test_the_installed_example_trains_two_steps(example_installed, tmp_path):
    listed = subprocess.run([sys.executable, "-m", "esopt_mp.envs", "list"], capture_output=True, text=True,
                            cwd=str(tmp_path), check=True)
    assert "guess_number" in json.loads(listed.stdout)["plugins"]
    p = _train(tmp_path / "run", "env.name=guess_number", "env.guess_number.high=4")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _history(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(x) and 0.0 <= x <= 1.0 for r in rows for x in r["returns"])
    cfg = json.load(open(tmp_path / "run" / "config.json"))
    assert cfg["env"]["guess_number"] == {"high": 4} and cfg["identity"]["env.guess_number.high"] == 4
    eps = [json.loads(line) for line in open(tmp_path / "run" / "trajectories.jsonl")]
    assert eps and all("between 1 and 4" in json.dumps(e) for e in eps if e.get("kind") == "train")
    # the section is part of the run's identity: the same run.dir with another value is refused, in one line
    p = _train(tmp_path / "run", "env.name=guess_number", "env.guess_number.high=5")
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "Traceback" not in p.stderr and last.startswith("error: "), p.stderr[-3000:]
    assert "holds another run (it differs in: env.guess_number.high 4 -> 5)" in last, last


def test_a_bad_section_is_one_line_naming_the_key(example_installed, tmp_path):
    """Each bad value of the plugin's section is refused naming its key: through launch/train.py's own route
    (open_sections, Hydra, build_config) in this process, and one of them launched: one line, exit 2."""
    from esopt_mp.config import ConfigError, build_config
    from tests.fixtures.configs import compose_config

    cases = (("env.guess_number.high=1", "env.guess_number.high: must be >= 2, got 1"),
             ("env.guess_number.hgh=3", "unknown config key 'env.guess_number.hgh'"),
             ("env.guess_number.high=many", "env.guess_number.high: expected an integer"))
    for override, want in cases:
        raw = compose_config("env.name=guess_number", override)
        with pytest.raises(ConfigError) as e:
            build_config(raw, 1)
        assert want in str(e.value) and "\n" not in str(e.value)
    override, want = cases[1]
    p = _train(tmp_path / "bad", "env.name=guess_number", override)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and want in lines[0], p.stderr[-2000:]


def _fake_dist(root, dist: str, entry: str, modules: dict[str, str]) -> str:
    """A minimal installed distribution (dist-info with an entry point) on a path of its own."""
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[esopt_mp.envs]\n{entry}\n")
    for name, src in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(src))
    return str(root)


def test_an_unknown_name_lists_plugins_and_a_broken_plugin_is_named_with_its_error(tmp_path):
    path = _fake_dist(tmp_path / "site", "broken-plugin", "broken = broken_mod:Env",
                      {"broken_mod": "import not_a_module_anywhere\n"})
    env = {"PYTHONPATH": path}
    p = _train(tmp_path / "run", "env.name=nope", env=env)
    assert p.returncode == 2 and "installed plugins: broken" in p.stderr and "built-in:" in p.stderr, p.stderr
    p = _train(tmp_path / "run", "env.name=broken", env=env)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-2000:]
    assert "broken_mod:Env (distribution broken-plugin) failed to import: ModuleNotFoundError" in lines[0]


NO_TASKS = '''
class Env:
    @classmethod
    def tasks(cls, split, n, seed):
        raise RuntimeError("the dataset server is down")

    def reset(self, task):
        raise AssertionError("never played")

    def step(self, text):
        raise AssertionError("never played")
'''


def test_a_plugin_whose_tasks_raise_is_one_line_naming_it_in_training_and_the_dry_run(tmp_path):
    path = _fake_dist(tmp_path / "site", "notasks-plugin", "notasks = notasks_mod:Env", {"notasks_mod": NO_TASKS})
    why = ("environment 'notasks': tasks('train', 8, 0) of plugin notasks_mod:Env (distribution notasks-plugin) "
           "raised RuntimeError: the dataset server is down")
    for dry, said in (("false", f"error: env.name=notasks: its tasks: {why}"),
                      ("true", f"error: env.name=notasks: its tasks: ValueError: {why}")):
        p = _train(tmp_path / "run", "env.name=notasks", f"run.dry_run={dry}", env={"PYTHONPATH": path})
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
        assert p.stderr.strip().splitlines()[-1] == said
    assert not os.path.exists(tmp_path / "run" / "history.jsonl")


NO_BOARD = NO_TASKS.replace('''        raise RuntimeError("the dataset server is down")''', '''        return [{"id": f"{split}{seed}-{i}"} for i in range(n)]

    def __init__(self, max_turns=2):
        raise RuntimeError("no board")''')


def test_a_plugin_whose_constructor_raises_is_one_line_naming_it_in_training(tmp_path):
    path = _fake_dist(tmp_path / "site", "noboard-plugin", "noboard = noboard_mod:Env", {"noboard_mod": NO_BOARD})
    p = _train(tmp_path / "run", "env.name=noboard", env={"PYTHONPATH": path})
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == ("error: env.name=noboard: building its environment raised "
                                                 "RuntimeError: no board")


CRASHY = '''
import random

from esopt_mp.envs.base import InfraError


class Crashy:
    """Task kind "ok" plays one turn; "model" raises in step (the model's failure); "infra" raises InfraError."""

    @classmethod
    def tasks(cls, split, n, seed):
        kinds = ["ok", "model", "infra"]
        return [{"id": f"{split}{seed}-{i}", "kind": kinds[i % 3]} for i in range(n)]

    def __init__(self, max_turns=2):
        self.max_turns = max_turns

    def reset(self, task):
        self.kind = task["kind"]
        return [{"role": "user", "content": "Say anything."}], {}

    def step(self, text):
        if self.kind == "model":
            raise ValueError("the reply broke the env")
        if self.kind == "infra":
            raise InfraError("the server went away")
        return [], 1.0, True, False, {}
'''


def test_a_plugin_whose_step_raises_follows_the_failure_rules(tmp_path):
    """step raising is the model's failure (scored 0 and counted); InfraError is left out (counted as infra)."""
    path = _fake_dist(tmp_path / "site", "crashy-plugin", "crashy = crashy_mod:Crashy", {"crashy_mod": CRASHY})
    p = _train(tmp_path / "run", "env.name=crashy", "env.n_train=3", "env.episodes_per_step=3",
               env={"PYTHONPATH": path})
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _history(tmp_path / "run")
    assert len(rows) == 2
    for r in rows:  # each member played one task of each kind: mean over ok (1) and model (0) = 0.5
        assert r["returns"] == [0.5, 0.5] and r["failures"] == {"model": 2, "wall_clock": 0, "infra": 2}


def test_the_horizon_crossover_runs_on_a_plugin_environment(example_installed, tmp_path):
    """tools/crossover.py on an environment the project did not write: ES and GRPO on equal budgets, the horizon
    being the plugin's own key; every run played the budget (the tool counts the trajectories)."""
    p = subprocess.run([sys.executable, "tools/crossover.py", "--env", "guess_number", "--horizon-key",
                        "env.guess_number.high", "--turns-per-horizon", "0", "--horizons", "4", "--seeds", "0",
                        "--methods", "es", "grpo", "--budget", "8", "--es-population", "2", "--es-episodes", "4",
                        "--pg-tasks", "2", "--pg-generations", "4", "--n-eval", "2", "--out", str(tmp_path / "x"),
                        "env.max_turns=3", "engine.max_new_tokens=8", "env.n_train=16"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout.strip().splitlines()[-1])["figures"]
    assert report["env"] == "guess_number" and {r["method"] for r in report["runs"]} == {"es", "grpo"}
    assert all(r["episodes"] == 8 and 0.0 <= r["after"] <= 1.0 for r in report["runs"])
    assert os.path.getsize(report["plot"]) > 0


DOWN = '''
class Down:
    """A plugin whose server is not there: its start-up check raises."""

    @classmethod
    def tasks(cls, split, n, seed):
        return [{"id": f"{split}{seed}-{i}"} for i in range(n)]

    @classmethod
    def check(cls):
        raise ConnectionRefusedError("nothing answers at 127.0.0.1:9")

    def reset(self, task):
        raise AssertionError("never played")

    def step(self, text):
        raise AssertionError("never played")
'''


def test_a_failed_start_up_check_is_one_line_and_nothing_is_played(tmp_path):
    path = _fake_dist(tmp_path / "site", "down-plugin", "down = down_mod:Down", {"down_mod": DOWN})
    p = _train(tmp_path / "run", "env.name=down", env={"PYTHONPATH": path})
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == ("error: env.name=down: the start-up check failed on rank 0: "
                                                 "ConnectionRefusedError: nothing answers at 127.0.0.1:9")
    assert not os.path.exists(tmp_path / "run" / "history.jsonl")
