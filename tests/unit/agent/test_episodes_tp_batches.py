"""A TP peer follows exactly the episode batches its leader plays (webarena_lite plays env.webarena_lite.max_browsers
episodes at a time), in training steps and in held-out evaluation: the peer's engine consumes every message the
leader sent and runs as many generations, then returns."""
import collections
import types

import pytest

import esopt_mp.agent.episodes as ep
from esopt_mp.agent.held_out import HeldOut
from esopt_mp.agent.episodes import AgentObjective
from esopt_mp.config import EnvConfig
from esopt_mp.core.types import Generation
from esopt_mp.engine.base import EngineStats, SamplingParams
from esopt_mp.engine.tp import TPEngine
from esopt_mp.core.types import Member
from tests.fixtures.tp_pair import RecordedTpPair


class _Inner:
    """An engine that samples one token per row, from the conversation's seed."""

    tokenizer, pad_id = None, 0

    def __init__(self):
        self.stats, self.calls = EngineStats(), 0

    def new_conversation(self, cid, seed):
        return types.SimpleNamespace(ids=[], seed=seed)

    def generate(self, convs, new_ids, params, max_new=None):
        self.calls += 1
        for c, ids in zip(convs, new_ids):
            c.ids += ids + [c.seed % 97]
        return [Generation([c.seed % 97], "x", "eos", 0, 0.0) for c in convs]

    def close(self):
        pass


def _player(cfg, rank, comm):
    dims = types.SimpleNamespace(distributed=True, tp=2, rank=rank, tp_rank=rank, is_tp_leader=rank == 0, dp_rank=0,
                                 dp=1, comm=comm)
    p = ep.EpisodePlayer.__new__(ep.EpisodePlayer)  # no browser: the batching is what is tested
    p.cfg, p.run_seed, p.dims, p.fixed_task, p.traj_path = cfg, 0, dims, False, None
    p.engine, p.spec, p.section = TPEngine(_Inner(), dims), cfg.spec, cfg.section
    p.max_concurrent = cfg.spec.max_concurrent(cfg.section)
    p.eval_cfg = p.train_cfg = types.SimpleNamespace(sampling=SamplingParams())
    p.recent_errors, p.failures = [], collections.Counter()
    p.eval_tasks = [{"id": i} for i in range(5)]
    p.train_tasks = [{"id": i} for i in range(7)]
    return p


@pytest.mark.parametrize("max_browsers,repeats", [(1, 1), (2, 1), (2, 3), (4, 2), (16, 1)])
def test_peer_follows_every_batch_the_leader_plays(monkeypatch, max_browsers, repeats):
    calls = {"run": 0, "episodes": 0}

    def run(eng, envs, tasks, seeds, c, contexts=None):
        calls["run"] += 1
        calls["episodes"] += len(tasks)
        assert len(tasks) <= max_browsers
        convs = [eng.new_conversation(i, s) for i, s in enumerate(seeds)]
        eng.generate(convs, [[1]] * len(convs), c.sampling)
        return [types.SimpleNamespace(ret=1.0, error=None, id="x", failure=None, floor=0.0) for _ in tasks]

    monkeypatch.setattr(ep, "run_episodes", run)
    monkeypatch.setattr(ep.EpisodePlayer, "make_env", lambda *a, **k: types.SimpleNamespace(close=lambda: None))
    cfg = EnvConfig(name="webarena_lite")
    cfg.section.max_browsers, cfg.eval_repeats, cfg.episodes_per_step = max_browsers, repeats, 6
    member = Member(step=0, index=0, seed=1, sign=1, pair=0)
    for n, play in ((5 * repeats, lambda p: HeldOut(p).evaluate()),
                    (6, lambda p: AgentObjective(p).evaluate_member(member))):
        calls.update(run=0, episodes=0)
        leader = _player(cfg, 0, RecordedTpPair())
        play(leader)
        assert calls["episodes"] == n and calls["run"] == -(-n // max_browsers)
        peer = _player(cfg, 1, RecordedTpPair(leader.dims.comm.log))
        play(peer)
        assert calls["run"] == -(-n // max_browsers)  # the peer played nothing
        assert peer.engine.inner.calls == leader.engine.inner.calls == calls["run"]  # ... and followed every batch
        assert peer.dims.comm.i == len(leader.dims.comm.log["msgs"])  # up to the leader's end, no further
        assert len(peer.engine.followed) == n


def test_failed_episodes_cost_where_failing_must_cost():
    """Skill validation compares contexts: an episode that fails (NaN: the infrastructure's) scores its env's failure
    return there, not left out -- else a candidate failing 3 of 4 episodes and winning one (1.0) beat a current
    skill scoring 0.5 on all four."""
    nan = float("nan")
    eps = [types.SimpleNamespace(ret=r, floor=-1.0) for r in (1.0, nan, nan, nan)]
    assert ep.return_total(eps) == (1.0, 1)  # training: ES shapes over finite returns
    assert ep.return_total(eps, failed_count=True) == (-2.0, 4)
