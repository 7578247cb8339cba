"""Sandbox basics; tool-call parsers; math_react and bin packing environments (attacks: test_sandbox_levels)."""

import pytest

from esopt_mp.chat.toolcalls import AnyParser, HermesJSONParser, QwenXMLParser, build_parser
from esopt_mp.envs import make
from esopt_mp.envs.sandbox import Sandbox, SandboxLimits


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(SandboxLimits(wall_s=3, cpu_s=3, memory_mb=256, nproc=16, fsize_mb=4, output_bytes=4096))


def test_plain_code_runs(sandbox):
    r = sandbox.run_python("import numpy as np\nprint(int(np.arange(5).sum()))")
    assert r.ok and r.stdout.strip() == "10"


def test_bad_level():
    with pytest.raises(ValueError, match=r"env\.sandbox\.level"):
        Sandbox(level="docker")


def test_parsers():
    xml = "think\n<tool_call>\n<function=python>\n<parameter=code>\nprint(1)\n</parameter>\n</function>\n</tool_call>"
    hermes = '<tool_call>{"name": "python", "arguments": {"code": "print(2)"}}</tool_call>'
    assert QwenXMLParser().parse(xml)[0].arguments == {"code": "print(1)"}
    assert HermesJSONParser().parse(hermes)[0].arguments == {"code": "print(2)"}
    assert AnyParser().parse(hermes)[0].name == "python" and AnyParser().parse(xml)[0].name == "python"
    assert HermesJSONParser().parse("<tool_call>{broken</tool_call>")[0].error
    assert AnyParser().parse("no tools here") == []
    with pytest.raises(ValueError, match="parser"):
        build_parser("yaml")


def test_math_react_episode(sandbox):
    from esopt_mp.envs.math_react import answers_match, extract_answer, generate

    env = make("math_react", max_turns=3, sandbox=sandbox)
    task = {"id": "t", "question": "What is 6 * 7?", "answer": "42"}
    env.reset(task)
    call = "<tool_call>\n<function=python>\n<parameter=code>\nprint(6 * 7)\n</parameter>\n</function>\n</tool_call>"
    msgs, reward, term, trunc, info = env.step(call)
    assert msgs[0]["role"] == "tool" and "42" in msgs[0]["content"] and not term
    msgs, reward, term, trunc, info = env.step("<tool_call>\n<function=python>\n<parameter=code>\nwhile True: pass\n</parameter>\n</function>\n</tool_call>")
    # wall clock and CPU limit are both 3 s: whichever fires first, the reason is named
    assert ("timeout" in msgs[0]["content"] or "cpu limit" in msgs[0]["content"]) and not term
    msgs, reward, term, trunc, info = env.step("The answer is \\boxed{42}")
    assert reward == 1.0 and term
    env.reset(task)
    assert env.step("\\boxed{41}")[1] == 0.0
    assert extract_answer("so\nAnswer: 3/4") == "3/4" and answers_match("\\frac{3}{4}", "0.75")
    assert len(generate(10, seed=1)) == 10 and generate(3, seed=1) == generate(3, seed=1)


def test_math_loader_reads_paper_splits():
    from esopt_mp.data import data_path
    from esopt_mp.envs.math_react import load_jsonl

    rows = load_jsonl(data_path("math/aime_2026.jsonl"))
    assert len(rows) == 30 and all(r["question"] and r["answer"] for r in rows)


def test_bin_packing_evaluator(sandbox):
    from esopt_mp.envs.ahd.bpp_online import FAIL_GAP

    env = make("heuristic", max_turns=2, sandbox=Sandbox(SandboxLimits(wall_s=20, cpu_s=20)))
    env.reset({"id": "b", "seed": 3, "n_instances": 2, "n_items": 200})
    best_fit = "```python\ndef score(item, bins):\n    return -(bins - item)\n```"
    msgs, reward, term, trunc, info = env.step(best_fit)
    assert info["error"] is None and 0 <= info["gap"] < 0.2 and "Gap" in msgs[0]["content"]
    msgs, reward, term, trunc, info = env.step("```python\ndef score(item, bins):\n    return bins[:1]\n```")
    assert "shape" in info["error"] and info["gap"] == FAIL_GAP and term and reward == -info["best_gap"]
    env.reset({"id": "b", "seed": 3, "n_instances": 2, "n_items": 200})
    msgs, reward, term, trunc, info = env.step("no code at all")
    assert info["error"] == "no code found"
