"""Failure kinds through a whole ES run, and a sandbox whose fork fails."""
import json
import math

import pytest

from esopt_mp.agent.loop import AgentConfig, run_episodes
from esopt_mp.config import build_config
from esopt_mp.envs import FAILURE_KINDS
from esopt_mp.parallel import LaunchEnv, init_distributed
from tests.web.scripted import ScriptedEngine
from tests.unit.test_failure_kinds import Zero


def test_crashing_on_lost_tasks_does_not_raise_a_members_return_and_the_ledger_counts_kinds(tmp_path, monkeypatch):
    """Four tasks a member plays every step: it wins one, crashes the env on two it would lose, and one meets a
    dead site. Its return is 1/3 (the crashes are losses; the site is left out), not 1.0 as when crashes were
    left out too; the ledger and the step log count 2 model failures and 1 infrastructure fault per member."""
    import esopt_mp.agent.episodes as episodes
    from esopt_mp.runner import run
    from esopt_mp.trainer import ESTrainer

    monkeypatch.setattr(episodes.EpisodePlayer, "make_env", lambda *a, **kw: Zero())
    cfg = build_config({
        "run": {"dir": str(tmp_path), "trajectories": False, "log_every": 1},
        "model": {"path": "builtin:tiny_agent"}, "objective": {"name": "agent"},
        "es": {"population": 2, "steps": 2, "mirrored": False},
        "env": {"name": "sudoku", "n_train": 4, "n_eval": 2, "episodes_per_step": 4, "max_turns": 1},
    })
    trainer = ESTrainer(cfg, init_distributed(LaunchEnv(0, 1, 0, "127.0.0.1", 0, "python"), 1, 1))
    for task, do in zip(trainer.objective.player.train_tasks, ("win", "crash", "crash", "infra")):
        task["do"] = do
    for task in trainer.objective.player.eval_tasks:
        task["do"] = "crash"
    try:
        run(trainer)
    finally:
        trainer.close()
    with open(tmp_path / "history.jsonl") as f:
        ledger = [json.loads(line) for line in f]
    assert [r["returns"] for r in ledger] == [[pytest.approx(1 / 3)] * 2] * 2
    assert [r["failures"] for r in ledger] == [{"model": 4, "wall_clock": 0, "infra": 2}] * 2
    with open(tmp_path / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f]
    steps = [m for m in metrics if "return_mean" in m]
    assert [m["episodes_failed"] for m in steps] == [{"model": 4, "wall_clock": 0, "infra": 2}] * 2
    evals = [m["eval_detail"] for m in metrics if "eval_detail" in m]
    assert evals and all(e["failed"] == 2 and e["failures"] == dict.fromkeys(FAILURE_KINDS, 0) | {"model": 2}
                         for e in evals)


def test_a_sandbox_that_cannot_start_is_the_infrastructures(monkeypatch):
    """The fork of a tool call fails (EAGAIN): math_react's and heuristic's episodes are infrastructure faults
    (NaN, left out), not failed answers; the sandbox still never raises for what the code does."""
    import errno
    import subprocess

    from esopt_mp.envs import make
    from esopt_mp.envs.ahd.bpp_online import generate
    from esopt_mp.envs.sandbox import Sandbox, SandboxLimits, SandboxStartError

    sandbox = Sandbox(SandboxLimits(wall_s=8, cpu_s=3))
    assert sandbox.run_python("raise SystemExit(3)").error  # the code's own failure: a result, not a raise

    def no_fork(*a, **kw):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(subprocess, "Popen", no_fork)
    with pytest.raises(SandboxStartError, match="could not start the sandbox"):
        sandbox.run_python("print(1)")
    tasks = [{"id": "q", "question": "1+1?", "answer": "2"}, generate(1, seed=0, n_instances=1, n_items=10)[0]]
    envs = [make("math_react", sandbox=sandbox), make("heuristic", sandbox=sandbox)]
    replies = [['<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'],
               ["```python\ndef score(item, bins):\n    return -bins\n```"]]
    eps = run_episodes(ScriptedEngine(replies), envs, tasks, [0, 1], AgentConfig(max_turns=2))
    assert [e.failure for e in eps] == ["infra", "infra"] and all(math.isnan(e.ret) for e in eps)
    assert all("SandboxStartError" in e.error for e in eps)
