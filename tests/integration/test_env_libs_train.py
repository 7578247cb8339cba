"""The environment libraries' adapters trained for 2 steps of ES with the tiny agent, as a user runs them
(subprocesses of launch/train.py); each test skips without its library."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = ["es.population=2", "es.steps=2", "env.n_train=8", "env.n_eval=4", "env.episodes_per_step=2",
         "run.eval_every=0", "run.checkpoint_every=0"]


def _train(run_dir, *overrides):
    return subprocess.run([sys.executable, "launch/train.py", *SHORT, *overrides, f"run.dir={run_dir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))


def _history(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "history.jsonl"))]


def test_reasoning_gym_composite_with_attempts_trains_two_steps(tmp_path):
    pytest.importorskip("reasoning_gym")
    p = _train(tmp_path / "run", "env.name=reasoning_gym", "env.reasoning_gym.dataset=composite",
               "env.reasoning_gym.weights={leg_counting:1,basic_arithmetic:2}", "env.reasoning_gym.attempts=2",
               "env.max_turns=2")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _history(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(x) and 0.0 <= x <= 1.0 for r in rows for x in r["returns"])
    eps = [json.loads(line) for line in open(tmp_path / "run" / "trajectories.jsonl")]
    assert {e["id"].split("-")[1] for e in eps} <= {"leg_counting", "basic_arithmetic"}
    assert all(len(e["turns"]) == 2 or e["turns"][-1]["info"]["correct"] for e in eps)  # a wrong answer is retried
    bad = _train(tmp_path / "bad", "env.name=reasoning_gym", "env.reasoning_gym.dataset=leg_countin")
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode == 2 and len(lines) == 1 and "close: leg_counting" in lines[0], bad.stderr[-2000:]


def test_textarena_game_trains_two_steps_by_its_own_rules(tmp_path):
    pytest.importorskip("textarena")
    p = _train(tmp_path / "run", "env.name=textarena", "env.textarena.game=GuessTheNumber-v0",
               "env.textarena.error_allowance=3", "env.max_turns=6")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _history(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(x) and -1.0 <= x <= 1.0 for r in rows for x in r["returns"])
    eps = [json.loads(line) for line in open(tmp_path / "run" / "trajectories.jsonl")]
    for e in eps:  # three invalid moves forgiven, the fourth ends the game (a valid guess would keep it going)
        last = e["turns"][-1]["info"]
        assert e["ended"] in ("terminated", "truncated") and e["id"].startswith("GuessTheNumber-v0-s")
        assert len(e["turns"]) == 4 if last.get("invalid_move") else len(e["turns"]) <= 6
    bad = _train(tmp_path / "bad", "env.name=textarena", "env.textarena.game=TicTacToe-v0")
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode == 2 and len(lines) == 1 and "TicTacToe-v0" in lines[0], bad.stderr[-2000:]


def test_openenv_server_game_trains_two_steps_over_its_sessions(tmp_path):
    pytest.importorskip("openenv")
    from tests.fixtures import openenv_server

    proc, url = openenv_server.start(max_concurrent=8)
    try:
        p = _train(tmp_path / "run", "env.name=openenv", f"env.openenv.url={url}", "env.openenv.action_field=guess",
                   'env.openenv.action_pattern="(\\d+)"', "env.openenv.max_concurrent=4",
                   "env.openenv.failure_return=-1.0", "env.max_turns=4")
    finally:
        openenv_server.stop(proc)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _history(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1] and all(r["failures"]["infra"] == 0 for r in rows)
    assert all(math.isfinite(x) and -1.0 <= x <= 1.0 for r in rows for x in r["returns"])
    eps = [json.loads(line) for line in open(tmp_path / "run" / "trajectories.jsonl")]
    for e in eps:  # the game's dense rewards summed (-0.1 a wrong guess, 1 the right one), or a failed episode's -1
        assert e["id"].startswith("openenv-s") and 1 <= len(e["turns"]) <= 4
        if e["failure"] is None:
            assert e["return"] == pytest.approx(sum(t["reward"] for t in e["turns"]), abs=1e-12)


def _returns_are_step_sums(run_dir):
    eps = [json.loads(line) for line in open(os.path.join(run_dir, "trajectories.jsonl"))]
    for e in eps:  # returns = "sum": the episode's return is the sum of its step rewards
        if e["failure"] is None:
            assert e["return"] == pytest.approx(sum(t["reward"] for t in e["turns"]), abs=1e-12)
    return eps


def test_gem_game_trains_two_steps_with_summed_rewards(tmp_path):
    pytest.importorskip("gem")
    p = _train(tmp_path / "run", "env.name=gem", "env.gem.id=game:GuessTheNumber-v0-easy", "env.max_turns=4")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _history(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(x) and -0.1 - 1e-9 <= x <= 1.0 for r in rows for x in r["returns"])
    eps = _returns_are_step_sums(tmp_path / "run")
    assert all(e["id"].startswith("game:GuessTheNumber-v0-easy-s") and 1 <= len(e["turns"]) <= 4 for e in eps)
    bad = _train(tmp_path / "bad", "env.name=gem", "env.gem.id=math:GSM8K")
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode == 2 and len(lines) == 1 and "dataset hub" in lines[0], bad.stderr[-2000:]


def test_gymnasium_frozen_lake_trains_two_steps_with_summed_rewards(tmp_path):
    pytest.importorskip("gymnasium")
    p = _train(tmp_path / "run", "env.name=gymnasium", "env.gymnasium.id=FrozenLake-v1", "env.max_turns=6")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _history(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(x) and -6.0 <= x <= 1.0 for r in rows for x in r["returns"])
    eps = _returns_are_step_sums(tmp_path / "run")
    assert all(e["id"].startswith("FrozenLake-v1-s") and 1 <= len(e["turns"]) <= 6 for e in eps)
    bad = _train(tmp_path / "bad", "env.name=gymnasium", "env.gymnasium.id=CartPole-v1")
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode == 2 and len(lines) == 1 and "no text rendering" in lines[0], bad.stderr[-2000:]
