"""Every trainer plays its episodes under the env section's loop settings (turns, wall clock, tokens, workers)."""
import dataclasses

import pytest

from esopt_mp.agent.loop import AgentConfig, build_agent_config
from esopt_mp.config import build_config
from esopt_mp.parallel import ParallelDims

ENV = {"name": "sudoku", "sudoku": {"size": 4, "mask_count": 1}, "max_turns": 3, "n_train": 4, "n_eval": 4, "episodes_per_step": 1,
       "episode_timeout_s": 37.0, "env_workers": 3, "max_episode_tokens": 500}  # none of them a default
LOOP = [f.name for f in dataclasses.fields(AgentConfig) if f.name != "sampling"]


def _loop(cfg: AgentConfig) -> dict:
    return {k: getattr(cfg, k) for k in LOOP}


def test_every_loop_setting_comes_from_the_env_section():
    env = build_config({"objective": {"name": "agent"}, "env": ENV}).env
    want = {k: getattr(env, k) for k in LOOP}  # an AgentConfig field the env section lacks fails here
    assert want != _loop(AgentConfig())
    assert _loop(build_agent_config(env, AgentConfig().sampling)) == want


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_the_baseline_trainers_rollouts_use_the_env_sections_settings(tmp_path, algo):
    from esopt_mp.baseline_trainer import BaselineTrainer, rollout_sampling

    cfg = build_config({"model": {"path": "builtin:tiny_agent"}, "objective": {"name": "agent"}, "es": {"steps": 1},
                        "env": ENV, "algo": {"name": algo, "tasks_per_step": 1, "generations": 2},
                        "run": {"dir": str(tmp_path), "trajectories": False}})
    trainer = BaselineTrainer(cfg, ParallelDims(1, 1, 1))
    assert _loop(trainer.rollout_cfg) == {k: getattr(cfg.env, k) for k in LOOP} == _loop(trainer.player.train_cfg)
    assert trainer.rollout_cfg.sampling == rollout_sampling(cfg.engine, cfg.algo)
