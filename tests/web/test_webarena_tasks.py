"""Real WebArena-Lite task configs scored by the benchmark's own evaluator, against stub login pages on loopback.

Answer-only tasks (string_match without an LLM judge) read no site state: logging in to a stub page and
sending the answer is enough to exercise BrowserGym's task setup, the chat, and WebArena-Lite's scorer.
"""
import pytest

from esopt_mp.envs import make
from esopt_mp.envs.web import tasks as wt
from esopt_mp.envs.web.config import WebConfig

pytestmark = [pytest.mark.browser, pytest.mark.slow]
CFG = WebConfig(settle_s=0.0, step_timeout_s=20.0)
# id: (site, correct answer) -- references from test_webarena_lite.raw.json (must_include / exact_match)
CASES = {4: "Impulse Duffle, Overnight Duffle, Hawkeye Yoga Short-32-Blue", 23: "Rachel and T. Gannon",
         58: "De Fer Coffee & Tea", 115: "N/A", 190: "65.32"}


def _task(i: int) -> dict:
    (task,), counts = wt.select([i], only_answer=True, judge=False)
    assert counts["kept"] == 1
    return task


@pytest.mark.parametrize("task_id", sorted(CASES))
def test_correct_answer_scores_one(task_id):
    env = make("webarena_lite", max_turns=3, web=CFG)
    try:
        msgs, _ = env.reset(_task(task_id))
        assert wt.load_configs() and msgs[-1]["content"].startswith("# Goal\n")
        _, r, term, _, _ = env.step(f'send_msg_to_user("{CASES[task_id]}")')
    finally:
        env.close()
    assert (r, term) == (1.0, True)


@pytest.mark.parametrize("task_id", [4, 115, 190])
def test_wrong_answer_scores_zero(task_id):
    env = make("webarena_lite", max_turns=3, web=CFG)
    try:
        env.reset(_task(task_id))
        _, r, term, _, _ = env.step('send_msg_to_user("Hollister, 12.00")')
    finally:
        env.close()
    assert (r, term) == (0.0, True)


def test_judged_tasks_are_excluded_and_counted_without_a_judge():
    kept, counts = wt.select(judge=False)
    judged = [c for c in wt.load_configs() if wt.needs_judge(c)]
    assert counts["excluded_needs_judge"] == len(judged) > 0
    assert counts["kept"] + len(judged) == counts["selected"] == 165
    assert not {t["id"] for t in kept} & {f"webarenalite.{c['old_task_id']}" for c in judged}
    assert wt.select(judge=True)[1]["kept"] == 165
