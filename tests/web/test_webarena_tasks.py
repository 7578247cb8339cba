"""Real WebArena-Lite task configs scored by the benchmark's own evaluator, against stub login pages on loopback.

Answer-only tasks (string_match without an LLM judge) read no site state: logging in to a stub page and
sending the answer is enough to exercise BrowserGym's task setup, the chat, and WebArena-Lite's scorer.
"""
import pytest

from esopt_mp.envs import make
from esopt_mp.envs.web import tasks as wt
from esopt_mp.envs.web.config import WebConfig
from tools.webarena_tasks import main

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


_RESET_SERVER = r'''
import http.server, json, os, sys, threading
hits = []
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        hits.append(self.path)
        body = b"Ready for duty!" if self.path == "/status" else b"ok"
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
url = f"http://127.0.0.1:{srv.server_address[1]}"
for s in ("SHOPPING", "SHOPPING_ADMIN", "REDDIT", "GITLAB", "WIKIPEDIA", "MAP", "HOMEPAGE"):
    os.environ[f"WA_{s}"] = url
os.environ["WA_FULL_RESET"] = url
from esopt_mp.envs.web import stack, tasks
stack.check()
tasks.full_reset()
print(json.dumps(hits))
'''


def test_full_reset_is_browsergyms_reset_protocol(monkeypatch):
    """env.webarena_lite.full_reset calls BrowserGym's WebArenaInstance.full_reset: GET $WA_FULL_RESET/reset, /status until
    ready, then every site (own process: the WebArena site URLs are read once per process)."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RESET_SERVER], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-2000:]
    hits = json.loads(out.stdout.strip().splitlines()[-1])
    assert hits[:2] == ["/reset", "/status"] and len(hits) >= 3  # then the sites' warm-up
    monkeypatch.delenv("WA_FULL_RESET", raising=False)
    with pytest.raises(RuntimeError, match="env.webarena_lite.full_reset: WA_FULL_RESET is not set"):
        wt.full_reset()


def test_preflight_checks_the_runs_own_task_set(capsys):
    """``--preflight -- <overrides>``: the trainer's start check on the task set the overrides give (slurm script)."""
    assert main(["--preflight", "--", "+experiment=webarena_tiny"]) == 0
    assert '"suite": "demo"' in capsys.readouterr().out
    assert main(["--preflight", "--", "+experiment=webarena_27b", "env.webarena_lite.task_ids=[99999]"]) == 1
    assert "unknown WebArena-Lite task ids [99999]" in capsys.readouterr().out
    run = ["--preflight", "--", "+experiment=webarena_27b", "env.episodes_per_step=1", "env.webarena_lite.answer_only=true"]
    assert main(run + ["env.webarena_lite.task_ids=[4,15]"]) == 0  # shopping_admin (train 4, held-out 15): a stub page
    assert '"train": 1, "heldout": 1' in capsys.readouterr().out
    assert main(run + ["env.webarena_lite.task_ids=[69,15]"]) == 1  # task 69 is on reddit: a closed port here
    assert "site reddit (WA_REDDIT=" in capsys.readouterr().out
    assert main(["--preflight", "--", "+experiment=webarena_27b", "env.webarena_lite.nope=1"]) == 1
    assert "env.webarena_lite.nope" in capsys.readouterr().out
