"""Infrastructure failures through a whole ES run: an episode the infrastructure failed is played once more, a
member whose every episode failed so is evaluated once more, and the ledger and the step log count both."""
import json
import math

import pytest

from esopt_mp.config import build_config
from esopt_mp.envs import InfraError
from esopt_mp.parallel import LaunchEnv, init_distributed


class Outage:
    """One turn, return 1.0; the first ``down`` resets of training episodes in the run meet a site that is down."""

    max_turns = 1
    failure_return = 0.0
    down = 0
    resets = 0

    def reset(self, task):
        if not task.get("train"):
            return [{"role": "user", "content": "go"}], {}
        Outage.resets += 1
        if Outage.resets <= Outage.down:
            raise InfraError(f"the site is down (reset {Outage.resets})")
        return [{"role": "user", "content": "go"}], {}

    def step(self, text):
        return [], 1.0, True, False, {}


def _run(tmp_path, monkeypatch, down: int):
    import esopt_mp.agent.episodes as episodes
    from esopt_mp.runner import run
    from esopt_mp.trainer import ESTrainer

    Outage.down, Outage.resets = down, 0
    monkeypatch.setattr(episodes.EpisodePlayer, "make_env", lambda *a, **kw: Outage())
    cfg = build_config({
        "run": {"dir": str(tmp_path), "log_every": 1, "eval_every": 0},
        "model": {"path": "builtin:tiny_agent"}, "objective": {"name": "agent"},
        "es": {"population": 2, "steps": 2, "mirrored": False},
        "env": {"name": "sudoku", "n_train": 4, "n_eval": 2, "episodes_per_step": 2, "max_turns": 1},
        "engine": {"max_new_tokens": 4},
    })
    trainer = ESTrainer(cfg, init_distributed(LaunchEnv(0, 1, 0, "127.0.0.1", 0, "python"), 1, 1))
    for task in trainer.objective.player.train_tasks:
        task["train"] = True
    try:
        run(trainer)
    finally:
        trainer.close()
    ledger = [json.loads(line) for line in open(tmp_path / "history.jsonl")]
    steps = [m for m in map(json.loads, open(tmp_path / "metrics.jsonl")) if "return_mean" in m]
    trajectories = [json.loads(line) for line in open(tmp_path / "trajectories.jsonl")]
    return ledger, steps, trajectories


def test_an_episode_the_site_failed_once_is_played_again_and_counts(tmp_path, monkeypatch):
    ledger, steps, traj = _run(tmp_path, monkeypatch, down=1)
    assert [r["returns"] for r in ledger] == [[1.0, 1.0]] * 2  # nothing lost
    assert [r["retries"] for r in ledger] == [{"episodes": 1, "members": 0}, {"episodes": 0, "members": 0}]
    assert [r["failures"]["infra"] for r in ledger] == [0, 0]
    assert steps[0]["retried"] == {"episodes": 1, "members": 0} and "retried" not in steps[1]
    again = [t for t in traj if "retried" in t]
    assert len(again) == 1 and "the site is down (reset 1)" in again[0]["retried"] and again[0]["return"] == 1.0
    assert Outage.resets == 2 * 2 * 2 + 1


def test_a_member_whose_every_episode_failed_is_evaluated_again_not_dropped(tmp_path, monkeypatch):
    """Member 0's two episodes fail, and fail again when played again (4 resets): it is evaluated once more and
    scores 1.0 instead of NaN."""
    ledger, steps, traj = _run(tmp_path, monkeypatch, down=4)
    assert ledger[0]["returns"] == [1.0, 1.0] and steps[0]["failed"] == 0
    assert ledger[0]["retries"] == {"episodes": 2, "members": 1}
    assert ledger[0]["failures"]["infra"] == 0  # only the evaluation that counts is counted
    assert steps[0]["retried"] == {"episodes": 2, "members": 1}
    first = [t for t in traj if t["kind"] == "train" and t["step"] == 0 and t["member"] == 0]
    assert len(first) == 2 and all(t["return"] == 1.0 and "evaluated again" in t["retried"] for t in first)


def test_a_member_the_infrastructure_fails_throughout_is_nan_after_its_second_evaluation(tmp_path, monkeypatch):
    """Member 0: 2 episodes, played again, evaluated again: 6 resets down, NaN. Member 1: 2 more down, played
    again and counted."""
    ledger, steps, _ = _run(tmp_path, monkeypatch, down=8)
    assert ledger[0]["returns"][0] is None and ledger[0]["returns"][1] == 1.0
    assert ledger[0]["retries"] == {"episodes": 4, "members": 1}
    assert ledger[0]["failures"]["infra"] == 2 and steps[0]["failed"] == 1
    assert ledger[1]["returns"] == [1.0, 1.0] and ledger[1]["retries"] == {"episodes": 0, "members": 0}
