"""A TP peer follows exactly as many episode batches as its leader plays (webarena_lite plays
env.webarena_lite.max_browsers episodes at a time), in training steps and in held-out evaluation."""
import collections
import types

import pytest

import esopt_mp.agent.objective as ob
from esopt_mp.envs.config import EnvConfig
from esopt_mp.objectives import Member


def _objective(cfg, leader, calls):
    o = ob.AgentObjective.__new__(ob.AgentObjective)  # no engine, no browser: the batching is what is tested
    o.cfg, o.run_seed, o.eval_round, o.traj_path, o.engine = cfg, 0, 0, None, None
    o.spec, o.section = cfg.spec, cfg.section
    o.eval_cfg = o.train_cfg = None
    o.context, o.trajectories, o.failures = None, [], collections.Counter()
    o.eval_tasks = [{"id": i} for i in range(5)]
    o.train_tasks = [{"id": i} for i in range(7)]
    comm = types.SimpleNamespace(all_reduce=lambda t, op, g: t)
    o.dims = types.SimpleNamespace(is_tp_leader=leader, dp_rank=0, dp=1, comm=comm, rank=0 if leader else 1)
    return o


@pytest.mark.parametrize("max_browsers,repeats", [(1, 1), (2, 1), (2, 3), (4, 2), (16, 1)])
def test_peer_follows_every_batch_the_leader_plays(monkeypatch, max_browsers, repeats):
    calls = {"run": 0, "follow": 0, "episodes": 0}

    def run(eng, envs, tasks, seeds, c, dims, contexts=None):
        calls["run"] += 1
        calls["episodes"] += len(tasks)
        assert len(tasks) <= max_browsers
        return [types.SimpleNamespace(ret=1.0, error=None, id="x", failure=None, floor=0.0) for _ in tasks]

    monkeypatch.setattr(ob, "run_episodes", run)
    monkeypatch.setattr(ob, "follow_episodes", lambda *a: calls.__setitem__("follow", calls["follow"] + 1))
    monkeypatch.setattr(ob.AgentObjective, "_make_env", lambda *a, **k: types.SimpleNamespace(close=lambda: None))
    cfg = EnvConfig(name="webarena_lite")
    cfg.section.max_browsers, cfg.eval_repeats, cfg.episodes_per_step = max_browsers, repeats, 6
    for leader in (True, False):
        _objective(cfg, leader, calls)._held_out()
    assert calls["episodes"] == 5 * repeats
    assert calls["run"] == calls["follow"] == -(-5 * repeats // max_browsers)
    calls.update(run=0, follow=0)
    member = Member(step=0, index=0, seed=1, sign=1)
    for leader in (True, False):
        _objective(cfg, leader, calls).evaluate(None, member)
    assert calls["run"] == calls["follow"] == -(-6 // max_browsers)


def test_failed_episodes_cost_where_failing_must_cost(monkeypatch):
    """Skill validation compares contexts: an episode that fails (NaN: the infrastructure's) scores its env's failure
    return there, not left out -- else a candidate failing 3 of 4 episodes and winning one (1.0) beat a current
    skill scoring 0.5 on all four."""
    nan = float("nan")
    monkeypatch.setattr(ob.AgentObjective, "play", lambda self, tasks, *a, **k: [
        types.SimpleNamespace(ret=r, floor=-1.0, failure=None if r == r else "infra") for r in (1.0, nan, nan, nan)])
    o = _objective(EnvConfig(name="sudoku"), True, {})
    assert o._play([0] * 4, [0] * 4, None) == (1.0, 1)  # training: ES shapes over finite returns
    assert o._play([0] * 4, [0] * 4, None, failed_count=True) == (-2.0, 4)
