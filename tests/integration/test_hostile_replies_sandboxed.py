"""Hostile model output through the environments that run code in the sandbox (math_react, heuristic, docvqa):
no reply may make one raise, in the agent loop too (the corpus: tests/unit/envs/test_hostile_replies.py)."""
import shutil

import pytest

from esopt_mp.envs import failure_return, make
from esopt_mp.envs.sandbox import Sandbox, SandboxLimits
from tests.unit.envs.test_hostile_replies import CORPUS, HOSTILE, _check_step


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(SandboxLimits(wall_s=8, cpu_s=3, memory_mb=512, output_bytes=4096))


def test_math_react_steps_on_hostile_text(sandbox):
    env = make("math_react", max_turns=10 ** 6, sandbox=sandbox)
    env.reset({"id": "q", "question": "1+1?", "answer": "2"})
    for reply in CORPUS:
        reward, term = _check_step(env, reply)
        if term:  # a final answer ends the episode: score it, start again
            assert reward == 0.0
            env.reset({"id": "q", "question": "1+1?", "answer": "2"})


@pytest.mark.parametrize("problem", ["bpp_online", "tsp_constructive", "tsp_aco"])
def test_heuristic_steps_on_hostile_text(sandbox, problem):
    from esopt_mp.envs import ahd
    from esopt_mp.envs.ahd.bpp_online import generate

    env = make("heuristic", max_turns=10 ** 6, sandbox=sandbox, problem=problem)
    task = generate(1, seed=0, n_instances=2, n_items=20)[0] if problem == "bpp_online" else \
        ahd.generate_tasks(problem, 1, seed=0)[0]
    env.reset(task)
    floor = failure_return(env)
    for reply in CORPUS:
        reward, term = _check_step(env, reply)
        assert not term and reward == 0.0
        assert env.best.score == floor  # no hostile reply beats the failure score


@pytest.mark.skipif(shutil.which("tesseract") is None, reason="tesseract not installed (apt-get install tesseract-ocr)")
def test_docvqa_steps_on_hostile_text(sandbox, tmp_path):
    from esopt_mp.envs.docvqa_gen import generate

    task = generate(1, str(tmp_path), seed=5)[0]
    env = make("docvqa", max_turns=10 ** 6, sandbox=sandbox)
    env.reset(task)
    for reply in CORPUS:
        reward, term = _check_step(env, reply)
        if term:
            env.reset(task)
    env.close()


def test_hostile_replies_through_the_agent_loop_leave_a_trajectory(sandbox, tmp_path):
    """The loop records each turn (its info, the env's feedback) and writes the trajectories file: a reply whose
    parsed arguments nest deeply, or whose feedback carries bad text, ends no episode and the batch goes on."""
    import json

    from esopt_mp.agent.loop import AgentConfig, run_episodes, write_trajectories
    from tests.web.scripted import ScriptedEngine

    deep = [h for h in HOSTILE if '"x":[' in h or "\\ud" in h or "\ud800" in h]
    task = {"id": "q", "question": "1+1?", "answer": "2"}
    envs = [make("math_react", max_turns=len(deep), sandbox=sandbox) for _ in range(2)]
    eps = run_episodes(ScriptedEngine([deep, deep[::-1]]), envs, [task, task], [0, 1],
                       AgentConfig(max_turns=len(deep)))
    assert [e.failure for e in eps] == [None, None] and all(e.ended != "failed" and e.turns for e in eps), eps
    write_trajectories(str(tmp_path / "t.jsonl"), eps, step=0)
    rows = [json.loads(line) for line in open(tmp_path / "t.jsonl")]
    assert [len(r["turns"]) for r in rows] == [len(e.turns) for e in eps]
