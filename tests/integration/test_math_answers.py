"""math_react's answer check: the same verdict on a batch's env threads as on the main thread, in a bounded time."""
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("math_verify")

from esopt_mp.envs import make  # noqa: E402
from esopt_mp.envs.answers import AnswerChecker  # noqa: E402
from esopt_mp.envs.base import call_envs  # noqa: E402
from esopt_mp.envs.sandbox import Sandbox, SandboxLimits  # noqa: E402

# (final answer, reference, correct): equal values written differently, and one wrong answer
CASES = [("0.5", "\\frac{1}{2}", 1.0), ("42.0", "42", 1.0), ("x^2+2x+1", "(x+1)^2", 1.0), ("41", "42", 0.0)]


@pytest.mark.parametrize("concurrent", [True, False], ids=["env-threads", "main-thread"])
def test_equal_answers_score_1_through_the_batched_steps(concurrent):
    sandbox = Sandbox(SandboxLimits(wall_s=3, cpu_s=3))  # a final answer runs no code: any level does
    envs = [make("math_react", max_turns=2, sandbox=sandbox) for _ in CASES]
    for k, (env, (_, ref, _)) in enumerate(zip(envs, CASES)):
        env.concurrent = concurrent  # True: call_envs steps the batch on its threads (as bwrap, unshare, root do)
        env.reset({"id": f"t{k}", "question": "q", "answer": ref})
    threads = set()
    step = type(envs[0]).step

    def spy(self, text):
        threads.add(threading.current_thread() is threading.main_thread())
        return step(self, text)

    for env in envs:
        env.step = spy.__get__(env)
    out = call_envs([(env, "step", f"So the answer is \\boxed{{{given}}}.") for env, (given, _, _) in zip(envs, CASES)])
    assert [err for _, err, _ in out] == [None] * len(CASES)
    assert threads == {not concurrent}
    assert [res[1] for res, _, _ in out] == [want for *_, want in CASES]
    assert all(res[2] for res, _, _ in out)  # every episode ended on its answer


def test_a_check_that_runs_on_is_cut_off_at_its_bound_and_the_next_one_is_answered():
    checker = AnswerChecker(workers=1, timeout_s=1.0)
    try:
        assert checker.check("1.0", "1")  # starts the worker: its start-up is not part of a check's bound
        with ThreadPoolExecutor(1) as ex:  # off the main thread, where math-verify's own timeout cannot work
            t = time.monotonic()
            verdict = ex.submit(checker.check, "9^{9^{9^{9}}}", "1").result()
            seconds = time.monotonic() - t
        assert verdict is False and checker.unchecked == 1
        assert seconds < 1.0 + 10.0  # the bound plus a margin for the kill; unbounded, the check runs for hours
        assert checker.check("42.0", "42") and checker.unchecked == 1  # a fresh worker took over
    finally:
        checker.close()


def test_a_worker_killed_from_outside_does_not_turn_a_verdict():
    checker = AnswerChecker(workers=1)
    try:
        assert checker.check("0.5", "\\frac{1}{2}")
        checker._idle[0].proc.kill()
        checker._idle[0].proc.wait()
        assert checker.check("0.5", "\\frac{1}{2}") and checker.unchecked == 0
    finally:
        checker.close()


def test_a_checker_that_cannot_start_fails_every_answer_alike(tmp_path, monkeypatch):
    """math-verify broken in the workers' environment: an answer equal to the reference as text is not waved
    through while every other answer is an infrastructure fault (the mean would then be over exact matches
    only): both raise InfraError, which names the workers' own error."""
    from esopt_mp.envs import InfraError, answers

    (tmp_path / "math_verify.py").write_text('raise ImportError("math_verify shadowed for the test")\n')
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    fresh = AnswerChecker(workers=1, start_timeout_s=60)
    monkeypatch.setattr(answers, "_checker", (os.getpid(), fresh))
    try:
        for given, ref in (("42", "42"), ("0.5", "\\frac{1}{2}")):
            with pytest.raises(InfraError, match="math_verify shadowed for the test"):
                answers.answers_match(given, ref)
    finally:
        fresh.close()
