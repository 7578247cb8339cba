"""math_react's held-out Mean@k / Pass@k through its own env (answers checked in the sandbox's worker processes)."""
import os
import types

from esopt_mp.agent.episodes import EpisodePlayer
from esopt_mp.agent.held_out import HeldOut
from tests.unit.agent.test_eval_at_k import _Comm


def test_math_react_reports_mean_and_pass_at_k_through_its_own_env(tmp_path):
    """math_react's held-out evaluation, episodes played for real (a scripted engine, the env scoring answers)."""
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "web"))
    from scripted import ScriptedEngine

    from esopt_mp.config import build_config

    cfg = build_config({"objective": {"name": "agent"},
                        "env": {"name": "math_react", "max_turns": 2, "n_train": 2, "episodes_per_step": 1,
                                "n_eval": 2, "eval_repeats": 4, "eval_temperature": 1.0, "max_episode_tokens": 4096,
                                "episode_timeout_s": 1234.0, "env_workers": 3}})
    dims = types.SimpleNamespace(rank=0, dp=1, dp_rank=0, tp=1, tp_rank=0, distributed=False, is_tp_leader=True,
                                 comm=_Comm())
    probe = EpisodePlayer(cfg.env, cfg.engine, 7, ScriptedEngine([]), dims)
    answers = [t["answer"] for t in probe.eval_tasks]
    right = [[1, 0, 0, 0], [0, 0, 1, 1]]  # question-major: which of the 4 samples answer correctly
    replies = [[f"\\boxed{{{answers[q]}}}" if right[q][s] else "\\boxed{-1}"] for q in range(2) for s in range(4)]
    traj = str(tmp_path / "t.jsonl")
    obj = EpisodePlayer(cfg.env, cfg.engine, 7, ScriptedEngine(replies), dims, traj)
    assert obj.eval_cfg.max_episode_tokens == obj.train_cfg.max_episode_tokens == 4096  # env.max_episode_tokens
    assert obj.eval_cfg.sampling.temperature == 1.0
    assert obj.eval_cfg.episode_timeout_s == obj.train_cfg.episode_timeout_s == 1234.0  # env.episode_timeout_s
    assert obj.eval_cfg.env_workers == obj.train_cfg.env_workers == 3
    assert HeldOut(obj).evaluate() == (3 / 8, {"k": 4, "questions": 2, "mean@4": 3 / 8, "pass@4": 1.0,
                                               "above_half": 3 / 8, "full": 3 / 8, "failed": 0,
                                               "failures": {"model": 0, "wall_clock": 0, "infra": 0}})
    rows = [json.loads(x) for x in open(traj)]
    assert [r["return"] for r in rows] == [float(x) for q in right for x in q] and {r["kind"] for r in rows} == {"eval"}
