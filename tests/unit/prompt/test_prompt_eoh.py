"""EoH's defining parts: thoughts (a braced description before the code) and generation-wise operators."""
import collections
import json

import pytest

from esopt_mp.prompt import EoHSearch, Program, SampleSearch, Trajectory
from esopt_mp.prompt.base import extract_thought
from esopt_mp.prompt.search import SEED_THOUGHT, operator

REF = "def f(x):\n    return x\n"
CODE = "def f(x):\n    d = {'a': 1}\n    return {x: d}\n"


def _reply(pre: str, code: str = CODE) -> str:
    return f"{pre}\n```python\n{code}```\n"


def test_thought_is_the_braced_sentence_before_the_code():
    assert extract_thought(_reply("{Square the input, then add one.}"), CODE) == "Square the input, then add one."
    assert extract_thought(_reply("No description, just code."), CODE) == ""  # code braces never count
    assert extract_thought(CODE, CODE) == ""  # a bare function: nothing before it
    assert extract_thought("", "") == ""
    # e2: the backbone idea first, set notation in prose, then the thought nearest the code; whitespace collapsed
    text = _reply("Backbone: both use values in {0, 1}.\n{Weight each   item\nby its ratio.}")
    assert extract_thought(text, CODE) == "Weight each item by its ratio."
    # a recap block of a parent before the new code: its braces are code, not the thought
    text = "{New idea.}\n```python\ndef g():\n    return {1: 2}\n```\nNow:\n" + _reply("", CODE)
    assert extract_thought(text, CODE) == "New idea."
    # a tool call's JSON object is not a thought
    assert extract_thought('{"name": "submit", "arguments": {"code": "def f(x): return x"}}', "") == ""
    assert extract_thought(_reply("{" + "x" * 5000 + "}"), CODE) == "x" * 600
    # realistic replies: set notation, LaTeX, inline code after the thought; a thought after the code; a draft
    assert extract_thought(_reply("{Choose best fit.} where the feasible set is {b : b >= item}."), CODE) == \
        "Choose best fit."
    assert extract_thought(_reply("{Best fit.} The score is $\\frac{1}{r_{i}}$."), CODE) == "Best fit."
    assert extract_thought(_reply("{Nearest first.} I keep `cache = {n: d[n] for n in todo}`."), CODE) == \
        "Nearest first."
    assert extract_thought(_reply("Here is the code:") + "{Take the nearest unvisited node.}", CODE) == \
        "Take the nearest unvisited node."
    assert extract_thought(_reply("<think>{a draft idea}</think>{Final idea.}"), CODE) == "Final idea."
    assert extract_thought(_reply("{Cost is $5 per bin and $3 per item.}"), CODE) == "Cost is $5 per bin and $3 per item."
    # no code extracted and an unclosed fence: the braces after it are code
    assert extract_thought("{Nearest neighbour.}\n```python\ndef f(x):\n    return {'alpha': beta_value}\n", "") == \
        "Nearest neighbour."


def test_trajectory_carries_the_thought_of_the_reply_that_made_the_program():
    turns = [{"response": _reply("{Use a dict.}"), "info": {"code": CODE, "score": -1.0, "error": None}},
             {"response": _reply("plain"), "info": {"code": CODE, "score": -2.0, "error": None}}]
    t = Trajectory.from_turns(-1.0, turns, member=3, slot=7)
    assert [p.thought for p in t.programs] == ["Use a dict.", ""] and (t.member, t.slot) == (3, 7)


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("members,episodes", [(1, 1), (2, 3), (3, 2), (4, 4), (5, 3), (8, 1), (7, 5)])
def test_each_operator_gets_an_equal_share_of_a_step(n, members, episodes):
    counts = collections.Counter(operator(n, m * episodes + e) for m in range(members) for e in range(episodes))
    want = {"e1", "e2", "m1", "m2"} if n >= 2 else {"m1", "m2"}
    assert set(counts) <= want and max(counts.values()) - min(counts.values()) <= 1
    if members * episodes >= len(want):
        assert set(counts) == want


def _pop(*inds):
    return json.dumps({"method": "eoh", "population": [
        {"code": c, "fitness": f, "op": "seed", "thought": t} for c, f, t in inds]})


def test_prompts_show_the_parents_thoughts_and_ask_for_one():
    e = EoHSearch(REF, size=4)
    ctx = _pop(("def f(x):\n    return 2 * x\n", -1.0, "Double it."), (REF, -2.0, "Identity."))
    for slot in range(8):
        p = e.render(ctx, 11, slot)
        op = operator(2, slot)
        assert ("I have 2 existing heuristics" in p) == op.startswith("e")
        assert "inside braces, like {...}" in p and "```python block" in p
        assert "Description: Double it." in p or "Description: Identity." in p
        if op.startswith("e"):
            assert "Description: Double it." in p and "Description: Identity." in p
    assert "backbone" not in e.render(ctx, 0, 0) and "backbone" in e.render(ctx, 0, 1)
    assert "parameters" in e.render(ctx, 0, 3) and "modified version" in e.render(ctx, 0, 2)
    assert "Description: (none given)" in e.render(_pop((REF, None, "")), 0, 0)
    # same seed and slot -> same prompt; the slot picks the operator, the seed the parents
    assert all(e.render(ctx, s, k) == e.render(ctx, s, k) for s in range(5) for k in range(5))
    assert len({e.render(ctx, s, 2) for s in range(30)}) == 2  # m1 over either parent, by the seed
    assert len({e.render(ctx, 4, k) for k in range(4)}) == 4


def test_population_entries_carry_thought_and_operator():
    e = EoHSearch(REF, size=5, thought="Return the input.")
    seed = json.loads(e.initial())["population"]
    assert seed == [{"code": REF, "fitness": None, "op": "seed", "thought": "Return the input."}]
    one = e.initial()
    trajs = [Trajectory(0.0, programs=[Program(f"c{k}", -float(k), None, f"t{k}" if k % 2 else "")], slot=k)
             for k in range(4)]
    ctx = e.update(trajs, one, 3)  # one individual rendered: slots alternate m1, m2
    pop = json.loads(ctx)["population"]
    assert [(p["code"], p["op"], p["thought"]) for p in pop] == [
        ("c0", "m1@3", ""), ("c1", "m2@3", "t1"), ("c2", "m1@3", ""), ("c3", "m2@3", "t3"),
        (REF, "seed", "Return the input.")]
    ctx = e.update([Trajectory(0.0, programs=[Program("best", 1.0, None, "Best.")], slot=5)], ctx, 4)
    assert json.loads(ctx)["population"][0] == {"code": "best", "fitness": 1.0, "op": "e2@4", "thought": "Best."}
    s = SampleSearch(REF)
    assert s.best(s.initial())["thought"] == SEED_THOUGHT
    assert s.best(s.update([trajs[1]], s.initial(), 0))["thought"] == "t1"


def test_pending_trajectories_stored_without_the_new_fields_still_load(tmp_path):
    from esopt_mp.prompt.config import PromptConfig
    from esopt_mp.prompt.run import PromptRun

    run = PromptRun(PromptConfig(optimiser="eoh"), REF, str(tmp_path))
    old = [{"ret": 0.5, "responses": ["r"], "programs": [{"code": "c", "score": 0.5, "error": None}],
            "member": 2, "feedback": [""]}]
    h = run.store.put(json.dumps(old))
    (tr,) = run._load(h)
    assert tr.programs == [Program("c", 0.5, None, "")] and tr.slot == -1 and tr.member == 2
    pop = json.loads(run.optimiser.update([tr], run.text, 0))["population"]
    assert pop[0] == {"code": "c", "fitness": 0.5, "op": "offspring@0", "thought": ""}
