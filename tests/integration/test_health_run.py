"""An agent run whose every episode errors says so loudly, with the errors, and stops when configured."""
import logging

import pytest

from esopt_mp.config import build_config
from esopt_mp.ledger import DegenerateRunError
from esopt_mp.parallel import LaunchEnv, init_distributed


class BrokenSandboxEnv:
    max_turns = 4

    def reset(self, task):
        raise PermissionError("bwrap: Creating new namespace failed: Resource temporarily unavailable")


def test_all_episodes_failing_is_loud_and_stops(tmp_path, monkeypatch, caplog):
    import esopt_mp.agent.episodes as episodes
    from esopt_mp.runner import run
    from esopt_mp.trainer import ESTrainer

    monkeypatch.setattr(episodes.EpisodePlayer, "make_env", lambda *a, **kw: BrokenSandboxEnv())
    cfg = build_config({
        "run": {"dir": str(tmp_path), "trajectories": False, "degenerate_steps": 2, "stop_on_degenerate": True},
        "model": {"path": "builtin:tiny_agent"}, "objective": {"name": "agent"}, "es": {"population": 4, "steps": 5},
        "env": {"name": "sudoku", "n_train": 4, "n_eval": 2, "episodes_per_step": 2},
    })
    trainer = ESTrainer(cfg, init_distributed(LaunchEnv(0, 1, 0, "127.0.0.1", 0, "python"), 1, 1))
    with caplog.at_level(logging.ERROR, logger="esopt_mp.ledger"), \
            pytest.raises(DegenerateRunError, match=r"2 consecutive steps learned nothing.*returns are NaN.*bwrap"):
        run(trainer)
    assert "step 0 learned nothing (1 step(s) in a row): all 4 returns are NaN: every episode failed; " \
           "sample errors: episode sudoku4" in caplog.text and "reset: PermissionError: bwrap" in caplog.text
    with open(tmp_path / "history.jsonl") as f:
        assert len(f.readlines()) == 2  # both no-op steps are in the ledger; nothing after them ran
