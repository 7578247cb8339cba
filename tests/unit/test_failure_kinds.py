"""Who a failed episode counts against: the model's own failures score the env's failure return, only the
infrastructure's are left out of a member's mean, and every kind is counted in the ledger and the step log."""
import math
import time

import pytest

from esopt_mp.agent.loop import AgentConfig, episode_record, run_episodes
from esopt_mp.config import build_config
from esopt_mp.envs import InfraError
from tests.web.scripted import ScriptedEngine


class ScriptedEnv:
    """One turn; what the step does is the task's ``do``: win, crash (the model's text broke it), infra, slow."""

    max_turns = 1
    failure_return = -2.0

    def reset(self, task):
        if task["do"] == "reset":
            raise OSError("the sandbox could not start")
        self.task = task
        return [{"role": "user", "content": "go"}], {}

    def step(self, text):
        do = self.task["do"]
        if do == "crash":
            raise RecursionError("maximum recursion depth exceeded")
        if do == "infra":
            raise InfraError("site shopping stopped answering")
        if do == "slow":
            time.sleep(0.05)
        return [], 1.0, True, False, {}


def test_each_failure_kind_scores_as_it_should():
    tasks = [{"id": d, "do": d} for d in ("win", "crash", "infra", "reset")]
    eps = run_episodes(ScriptedEngine([["a"]] * 4), [ScriptedEnv() for _ in tasks], tasks, [0, 1, 2, 3],
                       AgentConfig(max_turns=1))
    assert [e.failure for e in eps] == [None, "model", "infra", "infra"]
    assert eps[0].ret == 1.0 and eps[1].ret == ScriptedEnv.failure_return  # the model's crash is a loss
    assert math.isnan(eps[2].ret) and math.isnan(eps[3].ret)  # the infrastructure's: left out
    assert [e.floor for e in eps[1:]] == [ScriptedEnv.failure_return] * 3  # where none may be left out
    assert "RecursionError" in eps[1].error and "InfraError" in eps[2].error and "OSError" in eps[3].error
    assert all(episode_record(e)["failure"] == e.failure for e in eps)


def test_the_wall_clock_is_the_models():
    task = {"id": "slow", "do": "slow"}
    ep = run_episodes(ScriptedEngine([["a"]]), [ScriptedEnv()], [task], [0],
                      AgentConfig(max_turns=1, episode_timeout_s=0.01))[0]
    assert ep.failure == "wall_clock" and ep.ret == ScriptedEnv.failure_return and "wall clock" in ep.error


def test_a_nan_failure_return_is_refused():
    class Bad(ScriptedEnv):
        failure_return = math.nan

    with pytest.raises(ValueError, match="failure_return is NaN"):
        run_episodes(ScriptedEngine([["a"]]), [Bad()], [{"id": "c", "do": "crash"}], [0], AgentConfig(max_turns=1))


class Zero(ScriptedEnv):
    failure_return = 0.0


def test_the_baselines_count_failure_kinds_in_their_step_log(tmp_path, monkeypatch):
    """GRPO plays the same envs: its step log counts the kinds too, and trains on the model's failures (they are
    returns), while the infrastructure's are dropped."""
    import esopt_mp.agent.episodes as episodes
    from esopt_mp.baseline_trainer import BaselineTrainer
    from esopt_mp.parallel import ParallelDims

    monkeypatch.setattr(episodes.EpisodePlayer, "make_env", lambda *a, **kw: Zero())
    cfg = build_config({
        "model": {"path": "builtin:tiny_agent"}, "objective": {"name": "agent"}, "es": {"steps": 1},
        "env": {"name": "sudoku", "sudoku": {"size": 4, "mask_count": 1}, "max_turns": 1, "n_train": 2, "n_eval": 2,
                "episodes_per_step": 1},
        "algo": {"name": "grpo", "tasks_per_step": 2, "generations": 2},
        "run": {"dir": str(tmp_path), "trajectories": False},
    })
    trainer = BaselineTrainer(cfg, ParallelDims(1, 1, 1))
    try:
        for task, do in zip(trainer.player.train_tasks, ("crash", "infra")):
            task["do"] = do
        rec = trainer.step(0)
    finally:
        trainer.close()
    assert rec["episodes_failed"] == {"model": 2, "wall_clock": 0, "infra": 2}
    assert (rec["failed"], rec["return_mean"]) == (2, 0.0)
    assert rec["episodes"] == 2  # the update's episodes: the two the model failed; the two NaN ones are dropped
