"""Held-out Mean@k / Pass@k of the agent objective: the aggregation and the per-(question, sample) seeds."""
import math
import types

from esopt_mp.agent.objective import AgentObjective
from esopt_mp.es.seeds import stream_seed


class _Comm:
    def all_reduce(self, t, op="sum", dim="world"):
        return t.clone()


def _objective(k, tasks, returns, dp=1, dp_rank=0):
    """An AgentObjective whose episodes return ``returns[(task id, seed)]`` (no model: the aggregation only)."""
    obj = AgentObjective.__new__(AgentObjective)
    obj.cfg = types.SimpleNamespace(eval_repeats=k, name="docvqa")
    obj.eval_tasks, obj.run_seed, obj.eval_round, obj.eval_cfg = tasks, 7, 0, None
    obj.dims = types.SimpleNamespace(dp=dp, dp_rank=dp_rank, is_tp_leader=True, comm=_Comm())
    obj.played = []

    def play(ts, seeds, cfg, **tags):
        obj.played += [(t["id"], s) for t, s in zip(ts, seeds)]
        return [types.SimpleNamespace(ret=returns(t["id"], s)) for t, s in zip(ts, seeds)]

    obj.play = play
    return obj


def test_mean_and_pass_at_k():
    tasks = [{"id": "a"}, {"id": "b"}, {"id": "c"}]
    seed = {(q, s): stream_seed(7, "eval", 0, q, s) for q in range(3) for s in range(4)}
    table = {"a": [1.0, 0.0, 0.0, 0.0], "b": [0.2, 0.6, 0.4, 0.0], "c": [0.0, 0.0, 0.0, math.nan]}
    by_seed = {seed[(q, s)]: table[t["id"]][s] for q, t in enumerate(tasks) for s in range(4)}
    obj = _objective(4, tasks, lambda tid, s: by_seed[s])
    mean = obj.evaluate(None, None)
    finite = [x for row in table.values() for x in row if not math.isnan(x)]
    assert mean == sum(finite) / len(finite) == obj.last_eval["mean@4"]  # Mean@4: the failed episode is left out
    assert obj.last_eval["pass@4"] == (1.0 + 0.6 + 0.0) / 3  # the best of 4 per question
    assert obj.last_eval["above_half"] == 2 / 11 and obj.last_eval["k"] == 4
    assert sorted(s for _, s in obj.played) == sorted(seed.values())  # one seed per (question, sample)
    assert len(set(seed.values())) == 12


def test_sample_seeds_do_not_depend_on_the_dp_split():
    tasks = [{"id": str(i)} for i in range(5)]
    one = _objective(4, tasks, lambda tid, s: 0.0)
    one.evaluate(None, None)
    split = []
    for r in range(3):
        o = _objective(4, tasks, lambda tid, s: 0.0, dp=3, dp_rank=r)
        o.evaluate(None, None)
        split += o.played
    assert sorted(one.played) == sorted(split)
    second = _objective(4, tasks, lambda tid, s: 0.0)
    second.eval_round = 1
    second.evaluate(None, None)
    assert not {s for _, s in second.played} & {s for _, s in one.played}  # a new round draws new samples
