"""Sample and EoH as prompt optimisers: selection by fitness, invalid programs ignored, seeded prompts."""
import json
import math

import pytest

from esopt_mp.agent.loop import inject_context
from esopt_mp.prompt import EoHSearch, Program, SampleSearch, Trajectory

REF = "def f(x):\n    return x\n"


def _traj(*progs):
    return Trajectory(0.0, programs=[Program(c, s, e) for c, s, e in progs])


def test_trajectory_counts_every_evaluated_turn():
    turns = [{"response": "a", "info": {"code": "c1", "score": -1.0, "error": None}},
             {"response": "b", "info": {"code": "", "score": -3.0, "error": "no code found"}},
             {"response": "c", "info": {}}]
    t = Trajectory.from_turns(-1.0, turns)
    assert len(t.programs) == 2 and [p.valid for p in t.programs] == [True, False]
    from esopt_mp.envs.heuristic import extract_code
    from esopt_mp.envs.toolcalls import build_parser

    turns = [{"response": "try:\n```python\ndef score(item, bins):\n    return bins\n```", "info": {"score": -0.1}}]
    t = Trajectory.from_turns(-0.1, turns, extract=lambda x: extract_code(x, build_parser("any")))
    assert t.programs == [Program("def score(item, bins):\n    return bins\n", -0.1, None)]


def test_sample_keeps_the_best_valid_program_and_injects_nothing():
    s = SampleSearch(REF)
    ctx = s.initial()
    assert s.best(ctx)["code"] == REF and s.render(ctx, 7, 0) == ""
    ctx = s.update([_traj(("bad", 9.0, "boom"), ("a", -2.0, None)), _traj(("b", -1.0, None))], ctx, 0)
    assert s.best(ctx) == {"code": "b", "fitness": -1.0, "op": "sample@0", "thought": ""}
    same = s.update([_traj(("c", -1.0, None), ("d", math.nan, None))], ctx, 1)
    assert same == ctx  # a tie keeps the incumbent; NaN never enters


def test_eoh_selects_by_fitness_dedupes_and_keeps_its_size():
    e = EoHSearch(REF, size=3)
    ctx = e.update([_traj(("a", -5.0, None), ("b", -1.0, None), ("a", -0.5, None), ("x", 0.0, "crash"))],
                   e.initial(), 0)
    pop = json.loads(ctx)["population"]
    assert [p["code"] for p in pop] == ["b", "a", REF]  # evaluated first, best first; the seed last; no dup, no crash
    ctx = e.update([_traj(("c", -0.1, None), ("d", -3.0, None))], ctx, 1)
    assert [p["code"] for p in json.loads(ctx)["population"]] == ["c", "b", "d"]
    assert e.best(ctx)["fitness"] == -0.1


def test_eoh_prompts_are_seeded_and_use_the_population():
    e = EoHSearch(REF, size=4)
    one = e.initial()
    assert all(("one heuristic" in e.render(one, s, s)) for s in range(20))  # one individual: mutation only
    ctx = e.update([_traj(("def f(x):\n    return 2 * x\n", -1.0, None))], one, 0)
    prompts = [e.render(ctx, s, s) for s in range(40)]
    assert prompts == [e.render(ctx, s, s) for s in range(40)]
    assert any("I have 2 existing heuristics" in p for p in prompts) and any("one heuristic" in p for p in prompts)
    assert all("return 2 * x" in p or "return x" in p for p in prompts)


def test_bad_context_is_refused():
    with pytest.raises(ValueError, match="not a eoh search state"):
        EoHSearch(REF).update([], SampleSearch(REF).initial(), 0)


def test_inject_context_appends_to_the_system_prompt():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert inject_context(msgs, "C")[0]["content"] == "S\n\nC" and msgs[0]["content"] == "S"
    assert inject_context(msgs[1:], "C")[0] == {"role": "system", "content": "C"}


def test_schedules_and_restore_checks(tmp_path):
    from esopt_mp.prompt.config import PromptConfig
    from esopt_mp.prompt.run import PromptRun

    def run(**kw):
        return PromptRun(PromptConfig(optimiser="eoh", **kw), REF, str(tmp_path))

    alt, joint, only = run(mode="alternate"), run(mode="joint", every=3), run(mode="prompt_only", every=2)
    assert [(alt.es_on(t), alt.ctx_on(t)) for t in range(4)] == [(True, False), (False, True)] * 2
    assert [joint.ctx_on(t) for t in range(6)] == [False, False, True] * 2 and all(joint.es_on(t) for t in range(6))
    assert [only.ctx_on(t) for t in range(4)] == [False, True] * 2 and not any(only.es_on(t) for t in range(4))
    rec = joint.step(0, [_traj(("a", -1.0, None), ("b", 0.0, "err"))])  # not a context step: kept, still counted
    assert rec == {"context": joint.hash, "context_next": joint.hash, "programs": 2, "valid_programs": 1,
                   "pending": rec["pending"]}
    rec2 = joint.step(2, [_traj(("a", -1.0, None))])
    assert rec2["context_next"] != rec2["context"] and "a" in json.dumps(json.loads(joint.text))
    fresh = run(mode="joint", every=3)
    fresh.restore([dict(rec, step=0), dict(rec2, step=1)])
    assert (fresh.text, fresh.programs, fresh.valid) == (joint.text, 3, 2)
    with pytest.raises(ValueError, match="prompt"):  # a ledger that started from another context
        PromptRun(PromptConfig(optimiser="sample"), REF, str(tmp_path)).restore([dict(rec2, step=0)])


@pytest.mark.parametrize("optimiser", ["sample", "eoh"])
@pytest.mark.parametrize("mode", ["every", "alternate"])
def test_update_reads_every_trajectory_since_the_last_one_and_resume_rebuilds_them(tmp_path, optimiser, mode):
    # all programs count toward the budget, so all are searched: the best one came two steps before the update
    # (before: only the update step's programs were seen, and the worse "c" won)
    from esopt_mp.prompt.config import PromptConfig
    from esopt_mp.prompt.run import PromptRun

    kw = {"mode": "joint", "every": 3} if mode == "every" else {"mode": "alternate"}
    steps = [[_traj(("a", 5.0, None))], [_traj(("b", 1.0, None))], [_traj(("c", 0.0, None))]]
    if mode == "alternate":  # context steps are the odd ones: play a, b on 0 and c on 1
        steps = [steps[0] + steps[1], steps[2]]

    def run(d):
        return PromptRun(PromptConfig(optimiser=optimiser, population=2, **kw), REF, str(tmp_path / d))

    full = run("full")
    recs = [dict(full.step(t, tr), step=t) for t, tr in enumerate(steps)]
    assert "pending" in recs[0] and "pending" not in recs[-1] and full.pending == []
    best = (SampleSearch if optimiser == "sample" else EoHSearch).best(full.text)
    assert best["code"] == "a" and best["fitness"] == 5.0
    resumed = run("full")  # same run dir: the pending trajectories are read back from it
    resumed.restore(recs[:-1])
    assert [p.code for tr in resumed.pending for p in tr.programs] == [
        p.code for tr in sum(steps[:-1], []) for p in tr.programs]
    resumed.step(len(steps) - 1, steps[-1])
    assert resumed.text == full.text


def test_former_names_still_import_with_a_notice():
    """ContextOptimiser and ContextRun were renamed (one subsystem, one word): the old names work for one release,
    each with a DeprecationWarning naming the new one."""
    import esopt_mp.prompt as prompt
    import esopt_mp.prompt.run as run
    with pytest.warns(DeprecationWarning, match="now PromptOptimiser"):
        assert prompt.ContextOptimiser is prompt.PromptOptimiser
    with pytest.warns(DeprecationWarning, match="now PromptRun"):
        assert run.ContextRun is run.PromptRun
    with pytest.warns(DeprecationWarning, match="now PromptOptimiser"):  # from the module that defined it
        from esopt_mp.prompt.base import ContextOptimiser
    assert ContextOptimiser is prompt.PromptOptimiser
    with pytest.raises(AttributeError):
        prompt.NoSuchThing  # noqa: B018
