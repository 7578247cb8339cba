"""Held-out Mean@k / Pass@k of an agent run: the aggregation and the per-(question, sample) seeds."""
import math
import types

from esopt_mp.agent.held_out import HeldOut
from esopt_mp.es.seeds import stream_seed


class _Comm:
    def all_reduce(self, t, op="sum", dim="world"):
        return t.clone()


def _objective(k, tasks, returns, dp=1, dp_rank=0, floor=0.0):
    """A held-out evaluation whose episodes return ``returns[(task id, seed)]`` (no model: the aggregation only)."""
    player = types.SimpleNamespace(cfg=types.SimpleNamespace(eval_repeats=k, name="docvqa"), eval_tasks=tasks,
                                   run_seed=7, eval_cfg=None,
                                   dims=types.SimpleNamespace(dp=dp, dp_rank=dp_rank, is_tp_leader=True, comm=_Comm()))
    obj = HeldOut(player)
    obj.played = []

    def play(ts, seeds, cfg, **tags):
        obj.played += [(t["id"], s) for t, s in zip(ts, seeds)]
        rets = [returns(t["id"], s) for t, s in zip(ts, seeds)]  # a NaN: an infrastructure fault, as the loop says
        return [types.SimpleNamespace(ret=r, failure="infra" if math.isnan(r) else None, floor=floor) for r in rets]

    player.play = play
    return obj


def test_mean_and_pass_at_k():
    tasks = [{"id": "a"}, {"id": "b"}, {"id": "c"}]
    seed = {(q, s): stream_seed(7, "eval", q, s) for q in range(3) for s in range(4)}
    table = {"a": [1.0, 0.0, 0.0, 0.0], "b": [0.2, 0.6, 0.4, 0.0], "c": [0.0, 0.0, 0.0, math.nan]}
    by_seed = {seed[(q, s)]: table[t["id"]][s] for q, t in enumerate(tasks) for s in range(4)}
    obj = _objective(4, tasks, lambda tid, s: by_seed[s])
    mean, got = obj.evaluate()
    scored = [0.0 if math.isnan(x) else x for row in table.values() for x in row]
    assert mean == sum(scored) / 12 == got["mean@4"]  # Mean@4: the failed episode scores 0
    assert got["pass@4"] == (1.0 + 0.6 + 0.0) / 3  # the best of 4 per question
    assert got["above_half"] == 2 / 12 and got["k"] == 4 and got["failed"] == 1
    assert got["full"] == 1 / 12  # full marks: the one 1.0 (0.6 is partial credit)
    assert sorted(s for _, s in obj.played) == sorted(seed.values())  # one seed per (question, sample)
    assert len(set(seed.values())) == 12


def test_failed_episodes_count_as_zero_not_dropped():
    """Question a [1, 1], question b [NaN, NaN]: Mean@2 = Pass@2 = 0.5 (dropping failures said 1.0), 2 failed."""
    obj = _objective(2, [{"id": "a"}, {"id": "b"}], lambda tid, s: 1.0 if tid == "a" else math.nan)
    mean, got = obj.evaluate()
    assert mean == 0.5 and (got["mean@2"], got["pass@2"], got["failed"]) == (0.5, 0.5, 2)


def test_a_failed_episode_scores_the_envs_failure_return_not_zero():
    """Heuristic design: real scores are <= 0 and failing scores -3; an infrastructure fault scoring 0 would beat
    every real program. Question a [-1, -1], question b [NaN, NaN] with floor -3: Mean@2 = -2, Pass@2 = -2."""
    obj = _objective(2, [{"id": "a"}, {"id": "b"}], lambda tid, s: -1.0 if tid == "a" else math.nan, floor=-3.0)
    mean, got = obj.evaluate()
    assert mean == -2.0 and (got["pass@2"], got["failed"], got["failures"]["infra"]) == (-2.0, 2, 2)


def test_sample_seeds_do_not_depend_on_the_dp_split():
    tasks = [{"id": str(i)} for i in range(5)]
    one = _objective(4, tasks, lambda tid, s: 0.0)
    one.evaluate()
    split = []
    for r in range(3):
        o = _objective(4, tasks, lambda tid, s: 0.0, dp=3, dp_rank=r)
        o.evaluate()
        split += o.played
    assert sorted(one.played) == sorted(split)
    again = one.played[:]
    one.evaluate()  # a later evaluation of the same run: the same streams
    resumed = _objective(4, tasks, lambda tid, s: 0.0)
    resumed.round = 5  # a resumed run's count differs (it is not saved); the seeds do not
    resumed.evaluate()
    assert one.played == again + again and sorted(resumed.played) == sorted(again)
    assert {s for _, s in again} == {stream_seed(7, "eval", q, s) for q in range(5) for s in range(4)}


