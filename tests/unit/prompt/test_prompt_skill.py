"""Skill synthesis on recorded trajectories: edit format, merge of parallel batches, validation, determinism, config."""
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from esopt_mp.config import ConfigError, build_config
from esopt_mp.identity import config_hash
from esopt_mp.prompt import Trajectory, context_hash
from esopt_mp.prompt.skill import DEFAULT_SKILL, SkillSynthesis
from esopt_mp.prompt.skill_edits import Edit, apply_edits, merge, parse_edits, parse_skill

SKILL = """# SKILL.md
Lessons.

## Strategy
- read the task twice
- answer in one line

## Pitfalls
- do not guess
"""

# recorded episodes: two failures (one without a return) and two successes, with the environment's feedback
TRAJ = [Trajectory(0.0, ["<answer>12</answer>"], member=0, feedback=["wrong: expected 13"]),
        Trajectory(1.0, ["<answer>13</answer>"], member=1, feedback=["correct"]),
        Trajectory(float("nan"), ["..."], member=2),
        Trajectory(0.9, ["<answer>7</answer>"], member=3, feedback=["correct"])]



def reply_json(handler: BaseHTTPRequestHandler, obj) -> None:
    """A fake endpoint's 200 answer carrying ``obj`` as JSON."""
    out = json.dumps(obj).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(out)))
    handler.end_headers()
    handler.wfile.write(out)

def block(*objs, junk=()):
    return "Here are my edits:\n```edits\n" + "\n".join([json.dumps(o) for o in objs] + list(junk)) + "\n```\n"


def test_malformed_lines_are_dropped_with_their_reason_and_the_rest_stands():
    text = block({"op": "insert", "section": "Pitfalls", "text": "- check units"},
                 junk=["not json", '{"op": "move", "section": "Strategy", "anchor": "x"}',
                       '{"op": "replace", "section": "Strategy", "text": "y"}',
                       '{"op": "delete", "section": "Strategy", "anchor": "- do not guess", "text": "z"}',
                       '{"op": "insert", "section": "## Bad", "text": "t"}',
                       '{"op": "insert", "section": "Strategy", "text": "t", "why": "because"}'])
    edits, drops = parse_edits(text, batch=3)
    assert edits == [Edit("insert", "Pitfalls", "", "- check units", 3, 0)]
    reasons = [d["reason"] for d in drops]
    assert len(reasons) == 6 and all(d["batch"] == 3 for d in drops)
    assert reasons[0].startswith("not JSON") and "op must be one of" in reasons[1]
    assert "replace needs an anchor" in reasons[2] and "delete takes no text" in reasons[3]
    assert "section must be" in reasons[4] and "unknown fields ['why']" in reasons[5]
    assert parse_edits("I think the skill is fine.")[1][0]["reason"] == "no ```edits block in the proposal"


def test_line_breaks_of_any_kind_and_lone_surrogates_are_refused():
    """str.splitlines splits on \\r, \\u2028 ... too: such a text would open a section; a lone surrogate (valid JSON)
    crashed the run at hashing, on every rank and again after a resume."""
    text = block({"op": "insert", "section": "Pitfalls", "text": "a\r## Evil"},
                 {"op": "insert", "section": "New\u2028## Other", "text": "x"},
                 {"op": "insert", "section": "Pitfalls", "text": "smile \ud83d"},
                 {"op": "insert", "section": "Pitfalls", "text": "- fine"})
    edits, drops = parse_edits(text)
    assert [e.text for e in edits] == ["- fine"]
    assert [d["reason"].split(" ")[0] for d in drops] == ["text", "section", "text"]
    assert "single line" in drops[0]["reason"] and "surrogate" in drops[2]["reason"]


def test_conflicting_edits_are_merged_or_dropped_with_their_reason():
    a = [Edit("replace", "Strategy", "- read the task twice", "- read the task three times", 0, 0),
         Edit("insert", "Pitfalls", "", "- check units", 0, 1)]
    b = [Edit("replace", "Strategy", "- read the task twice", "- skim the task", 1, 0),  # loses to batch 0
         Edit("insert", "Pitfalls", "", "- check units", 1, 1),  # the same edit: applied once
         Edit("delete", "Strategy", "- answer in one line", "", 1, 2),
         Edit("insert", "Strategy", "- answer in one line", "- then stop", 1, 3)]  # its anchor goes: dropped
    c = [Edit("replace", "Strategy", "- answer in one line", "- answer in one short line", 2, 0)]  # beats the delete
    kept, out = merge([a, b, c])
    assert [(e.batch, e.index) for e in kept] == [(0, 1), (1, 3), (0, 0), (2, 0)]  # inserts first
    why = {(d["batch"], d["index"]): d["reason"] for d in out}
    assert why[(1, 0)] == "conflict: replace of the same line by batch 0 wins"
    assert why[(1, 1)] == "merged: same edit as batch 0"
    assert why[(1, 2)] == "conflict: replace of the same line by batch 2 wins"
    assert (1, 3) not in why
    text, failed = apply_edits(SKILL, kept)
    assert not failed
    assert parse_skill(text)[1] == {"Strategy": ["- read the task three times", "- answer in one short line",
                                                 "- then stop"], "Pitfalls": ["- do not guess", "- check units"]}
    # an insert whose anchor a kept delete removes has lost its place
    kept, out = merge([[Edit("delete", "Pitfalls", "- do not guess", "", 0, 0)],
                       [Edit("insert", "Pitfalls", "- do not guess", "- never", 1, 0)]])
    assert [e.op for e in kept] == ["delete"] and out[0]["reason"] == "conflict: its anchor is deleted by batch 0"
    _, failed = apply_edits(SKILL, [Edit("delete", "Strategy", "- no such line"), Edit("replace", "Nope", "x", "y")])
    assert [f["reason"] for f in failed] == ["anchor not found in section 'Strategy'", "no section 'Nope'"]


class Scripted:
    """A recorded proposer: the answer of (step, batch), and the prompts it was shown."""

    def __init__(self, answers):
        self.answers, self.prompts = answers, []

    def __call__(self, prompt, step, batch):
        self.prompts.append(prompt)
        return self.answers[(step, batch)]


def _opt(answers, scores, tmp_path=None, batch=2):
    """scores: skill text -> held-out return (the validation callable, counted)."""
    calls = []

    def validate(text, step, steps):
        calls.append(context_hash(text))
        return scores(text)

    log = str(tmp_path / "skill.jsonl") if tmp_path else None
    return SkillSynthesis(Scripted(answers), validate, batch=batch, initial=SKILL, log_path=log), calls


def test_an_edit_that_lowers_the_held_out_return_is_rejected(tmp_path):
    bad = block({"op": "delete", "section": "Pitfalls", "anchor": "- do not guess"})
    opt, calls = _opt({(0, 0): bad, (0, 1): "no edits"}, lambda t: 0.8 if "do not guess" in t else 0.5, tmp_path)
    start = opt.initial()
    assert opt.update(TRAJ, start, 0) == start
    assert opt.last["kept"] is False and (opt.last["val_before"], opt.last["val_after"]) == (0.8, 0.5)
    assert opt.last["evaluations"] == 2 == len(calls) and opt.evaluations == 2 and opt.last["malformed"] == 1
    rec = json.loads((tmp_path / "skill.jsonl").read_text())
    assert rec["decision"] == "rejected: held-out return lower" and rec["malformed_lines"][0]["batch"] == 1

    good = block({"op": "insert", "section": "Pitfalls", "text": "- check the expected value"})
    opt, calls = _opt({(5, 0): good, (5, 1): good}, lambda t: 0.9 if "expected value" in t else 0.5)
    new = opt.update(TRAJ, start, 5)
    assert "- check the expected value" in parse_skill(new)[1]["Pitfalls"] and opt.last["kept"] is True
    assert opt.ledger_fields()["skill"]["applied"] == 1 and opt.last["conflicts"] == 0  # the copy was merged
    # no change proposed: nothing to validate
    opt, calls = _opt({(1, 0): "nothing", (1, 1): "nothing"}, lambda t: 0.0)
    assert opt.update(TRAJ, start, 1) == start and calls == [] and opt.last["evaluations"] == 0


def test_the_proposer_reads_failed_and_successful_episodes_in_batches():
    opt, _ = _opt({(0, 0): "", (0, 1): ""}, lambda t: 0.0)
    opt.update(TRAJ, opt.initial(), 0)
    first, second = opt.proposer.prompts
    assert "## Failed episodes" in first and "## Successful episodes" in first and "wrong: expected 13" in first
    assert "member 2, return failed (no return)" in second and "member 3, return 0.9" in second
    assert "## Strategy" in first and "```edits" in first
    long = [Trajectory(0.0, [f"reply {k}" for k in range(10)], feedback=[f"fb {k}" for k in range(10)])]
    shown = opt.prompt(opt.initial(), long)  # a long episode shows its last turns only
    assert "(6 earlier turns omitted)" in shown and "Reply 7: reply 6" in shown and "reply 5" not in shown


def test_same_inputs_give_the_same_skill():
    answers = {(0, 0): block({"op": "insert", "section": "Strategy", "anchor": "- read the task twice",
                              "text": "- underline the numbers"}),
               (0, 1): block({"op": "insert", "section": "Tools", "text": "- use the calculator"})}
    hashes = set()
    for _ in range(2):
        opt, _ = _opt(answers, lambda t: float(len(t)))
        hashes.add(context_hash(opt.update(TRAJ, opt.initial(), 0)))
    assert len(hashes) == 1 and hashes != {context_hash(SKILL)}
    assert SkillSynthesis(None, None).initial() == DEFAULT_SKILL


@pytest.mark.parametrize("override,key", [
    ({"skill": {"batch": 0}}, "prompt.skill.batch"),
    ({"skill": {"proposer": "oracle"}}, "prompt.skill.proposer"),
    ({"skill": {"proposer": "endpoint", "model": "m"}}, "prompt.skill.url"),
    ({"skill": {"proposer": "endpoint", "url": "http://h:1"}}, "prompt.skill.model"),
    ({"skill": {"val_tasks": 0}}, "prompt.skill.val_tasks"),
    ({"skill": {"temperature": -1.0}}, "prompt.skill.temperature"),
    ({"skill": {"success": float("nan")}}, "prompt.skill.success"),
    ({"skill": {"initial": "/no/such/SKILL.md"}}, "prompt.skill.initial"),
    ({"skill": {"colour": 1}}, "prompt.skill.colour"),
])
def test_bad_skill_config_is_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_config({"objective": {"name": "agent"}, "env": {"name": "sudoku"},
                      "prompt": {"optimiser": "skill", **override}})


def test_skill_needs_an_agent_objective_but_any_environment():
    with pytest.raises(ConfigError, match=r"prompt\.optimiser"):
        build_config({"prompt": {"optimiser": "skill"}})
    for env in ("sudoku", "math_react", "heuristic"):
        assert build_config({"objective": {"name": "agent"}, "env": {"name": env},
                             "prompt": {"optimiser": "skill"}}).prompt.optimiser == "skill"


def test_hashes_default_eoh_unchanged_skill_settings_count():
    assert config_hash(build_config({}), None) == "c999d5ed83fd066a"
    agent = {"objective": {"name": "agent"}, "env": {"name": "heuristic"}}
    h = lambda p: config_hash(build_config({**agent, "prompt": p}), None)  # noqa: E731
    assert h({"optimiser": "eoh"}) == h({"optimiser": "eoh", "skill": {"batch": 7}})  # not an eoh setting
    assert h({"optimiser": "skill"}) != h({"optimiser": "skill", "skill": {"batch": 7}})
    assert h({"optimiser": "skill"}) == h({"optimiser": "skill", "skill": {"key_env": "MY_KEY"}})


def test_endpoint_proposer_posts_chat_completions(monkeypatch):
    from esopt_mp.prompt.proposers import EndpointProposer

    seen = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            seen["path"], seen["auth"] = self.path, self.headers.get("Authorization")
            seen["body"] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            reply_json(self, {"choices": [{"message": {"content": block({"op": "insert", "section": "S",
                                                                          "text": "t"})}}]})

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("SKILL_TEST_KEY", "sekrit")
        monkeypatch.setitem(__import__("sys").modules, "openai", None)  # the urllib path, whatever is installed
        p = EndpointProposer(f"http://127.0.0.1:{srv.server_port}", "judge", "SKILL_TEST_KEY", max_tokens=32)
        edits, drops = parse_edits(p("propose", 12345))
    finally:
        srv.shutdown()
    assert seen["path"] == "/v1/chat/completions" and seen["auth"] == "Bearer sekrit"
    assert seen["body"]["model"] == "judge" and seen["body"]["seed"] == 12345
    assert seen["body"]["messages"] == [{"role": "user", "content": "propose"}]
    assert [e.text for e in edits] == ["t"] and not drops
    with pytest.raises(ValueError, match=r"prompt\.skill\.url"):
        EndpointProposer("ftp://x", "m")


def test_webarena_skill_profile_composes():
    from tests.fixtures.configs import compose_config

    cfg = build_config(compose_config("+experiment=webarena_skill"))
    assert (cfg.prompt.optimiser, cfg.env.name, cfg.prompt.skill.batch) == ("skill", "webarena_lite", 4)


def test_a_proposer_answering_all_batches_at_once_is_asked_once_and_no_trajectories_ask_nothing():
    class Many:
        def __init__(self):
            self.calls = []

        def __call__(self, prompt, step, batch):
            raise AssertionError("many() answers every batch")

        def many(self, prompts, step):
            self.calls.append((len(prompts), step))
            return [block({"op": "insert", "section": "Pitfalls", "text": f"- from batch {b}"}) for b in
                    range(len(prompts))]

    p = Many()
    opt = SkillSynthesis(p, lambda text, step, steps: 1.0, batch=3, initial=SKILL)
    new = opt.update(TRAJ, opt.initial(), 2)
    assert p.calls == [(2, 2)] and parse_skill(new)[1]["Pitfalls"][-2:] == ["- from batch 0", "- from batch 1"]
    assert opt.update([], new, 3) == new and p.calls == [(2, 2)] and opt.last["batches"] == 0


def test_a_fence_inside_a_json_string_does_not_cut_the_block_and_an_unclosed_block_is_recorded():
    """The block closes at the first line that is only ```; a ``` inside a text is content, the edits after it
    stand. An unclosed block (a proposal cut by its token budget) is read to the end, with a recorded reason."""
    first = {"op": "insert", "section": "Pitfalls", "text": "wrap code in ``` fences"}
    second = {"op": "insert", "section": "Strategy", "text": "- then run it"}
    edits, drops = parse_edits(block(first, second) + "\n```edits\n" + json.dumps(second) + "\n```\n")
    assert [e.text for e in edits] == ["wrap code in ``` fences", "- then run it"] and drops == []
    cut = "```edits\n" + json.dumps(first) + "\n" + json.dumps(second) + "\n{\"op\": \"ins"
    edits, drops = parse_edits(cut, batch=1)
    assert [e.text for e in edits] == ["wrap code in ``` fences", "- then run it"]
    assert [d["reason"].split(":")[0] for d in drops] == ["the ```edits block is not closed", "not JSON"]
    assert all(d["batch"] == 1 for d in drops)


def test_trajectories_carry_their_step_and_pending_sets_stored_before_the_field_still_load(tmp_path):
    import dataclasses
    import types

    from esopt_mp.prompt import ContextStore
    from esopt_mp.prompt.run import PromptRun

    store = ContextStore(str(tmp_path))
    old = [{"ret": 0.5, "responses": ["r"], "programs": [{"code": "c", "score": 1.0, "error": None}], "member": 2,
            "feedback": ["fb"]}]
    new = Trajectory.from_turns(0.25, [{"response": "x", "info": {"score": 0.25, "code": "c"}}], member=1, step=3)
    loaded = PromptRun._load(types.SimpleNamespace(store=store), store.put(json.dumps(old)))
    again = PromptRun._load(types.SimpleNamespace(store=store), store.put(json.dumps([dataclasses.asdict(new)])))
    assert (loaded[0].step, loaded[0].member, loaded[0].programs[0].score) == (-1, 2, 1.0)
    assert again == [new] and new.step == 3


def test_a_draft_block_inside_think_is_not_the_proposal():
    draft = '```edits\n{"op": "insert", "section": "Pitfalls", "text": "draft"}\n```'
    final = '```edits\n{"op": "insert", "section": "Pitfalls", "text": "final"}\n```'
    edits, drops = parse_edits(f"<think>\n{draft}\n</think>\n{final}\n")
    assert [e.text for e in edits] == ["final"] and not drops
    edits, drops = parse_edits(f"<think>\n{draft}\n</think>\nno edits after all")
    assert edits == [] and drops[0]["reason"].startswith("no ```edits block")
    edits, _ = parse_edits(f"{draft}\n</think>\n{final}\n")  # the template opened the reasoning block itself
    assert [e.text for e in edits] == ["final"]
    # an edit whose text mentions the tag is an edit, not the end of a reasoning block
    said = '```edits\n{"op": "insert", "section": "Pitfalls", "text": "End reasoning with </think> first."}\n```'
    for text in (said, f"<think>draft</think>\n{said}"):
        assert [e.text for e in parse_edits(text)[0]] == ["End reasoning with </think> first."]
