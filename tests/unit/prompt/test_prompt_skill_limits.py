"""Skill synthesis's limits: the SKILL.md size cap (prompt.skill.max_chars) and the endpoint's request timeout
(prompt.skill.timeout_s)."""
import json
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from esopt_mp.config import ConfigError, build_config
from esopt_mp.identity import config_hash
from esopt_mp.prompt.skill import SkillSynthesis, build_skill
from tests.unit.prompt.test_prompt_skill import SKILL, TRAJ, Scripted, block


def _agent(skill):
    return build_config({"objective": {"name": "agent"}, "env": {"name": "sudoku"},
                         "prompt": {"optimiser": "skill", "skill": skill}})


def test_a_candidate_over_max_chars_is_rejected_before_validation(tmp_path):
    long = "- " + "x" * 150
    answers = {(0, 0): block({"op": "insert", "section": "Pitfalls", "text": long}),
               (0, 1): block({"op": "insert", "section": "Strategy", "text": long[:-1]})}
    calls = []
    opt = SkillSynthesis(Scripted(answers), lambda text, step, steps: calls.append(text) or 1.0, batch=2,
                         initial=SKILL, log_path=str(tmp_path / "skill.jsonl"), max_chars=300)
    start = opt.initial()
    n = len(start) + len(long) + len(long[:-1]) + 2  # both lines inserted
    assert opt.update(TRAJ, start, 0) == start and calls == [] and opt.evaluations == 0
    rec = json.loads((tmp_path / "skill.jsonl").read_text())
    why = f"rejected: {n} characters, over prompt.skill.max_chars=300"
    assert rec["decision"] == why and rec["chars"] == n and rec["evaluations"] == 0 and rec["kept"] is False
    fields = opt.ledger_fields()["skill"]
    assert fields["decision"] == why and fields["applied"] == 0 and fields["val_before"] is None
    # under the cap the same edits are validated and kept
    opt = SkillSynthesis(Scripted(answers), lambda text, step, steps: calls.append(text) or 1.0, batch=2,
                         initial=SKILL, max_chars=n)
    assert len(opt.update(TRAJ, start, 0)) == n and len(calls) == 2 and opt.last["decision"].startswith("kept")
    with pytest.raises(ValueError, match=r"prompt\.skill\.max_chars: the initial SKILL\.md has"):
        SkillSynthesis(None, None, initial=SKILL, max_chars=50)


def test_max_chars_and_timeout_s_reach_their_components_and_bad_values_name_the_key():
    cfg = _agent({"max_chars": 250, "timeout_s": 7.5})
    assert (cfg.prompt.skill.max_chars, cfg.prompt.skill.timeout_s) == (250, 7.5)
    assert (_agent({}).prompt.skill.max_chars, _agent({}).prompt.skill.timeout_s) == (4000, 120.0)
    opt = build_skill(cfg.prompt, {"proposer": None, "validate": None}, None, 0)
    assert opt.max_chars == 250
    for bad, key in [({"max_chars": 199}, "max_chars"), ({"timeout_s": 0}, "timeout_s"),
                     ({"timeout_s": float("inf")}, "timeout_s")]:
        with pytest.raises(ConfigError, match=rf"prompt\.skill\.{key}: must be"):
            _agent(bad)
    h = lambda s: config_hash(_agent(s), None)  # noqa: E731
    assert h({}) == h({"timeout_s": 5.0}) != h({"max_chars": 300})  # how long a request waits is not a result


def test_the_endpoint_request_gives_up_after_timeout_s(monkeypatch):
    """A hung endpoint costs timeout_s, then the batch proposes nothing (dropped with the error as its reason)."""
    from esopt_mp.agent.loop import AgentConfig
    from esopt_mp.parallel import LaunchEnv, init_distributed
    from esopt_mp.agent.skill_hooks import skill_hooks
    from esopt_mp.prompt.skill_edits import parse_edits

    class Slow(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            time.sleep(1.5)
            out = json.dumps({"choices": [{"message": {"content": block({"op": "insert", "section": "S",
                                                                          "text": "t"})}}]}).encode()
            try:
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
            except OSError:  # the client gave up
                pass

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setitem(sys.modules, "openai", None)  # the urllib path
    cfg = _agent({"proposer": "endpoint", "url": f"http://127.0.0.1:{srv.server_port}", "model": "m",
                  "timeout_s": 0.3}).prompt.skill
    dims = init_distributed(LaunchEnv(0, 1, 0, "127.0.0.1", 0, "python"), 1, 1)
    player = types.SimpleNamespace(train_cfg=AgentConfig(), run_seed=0, dims=dims, engine=None)
    try:
        said = skill_hooks(player, cfg)["proposer"]("propose", 0, 0)
    finally:
        srv.shutdown()
    assert said.startswith("(endpoint error:") and "no complete answer within prompt.skill.timeout_s" in said
    assert parse_edits(said)[1][0]["reason"] == "no ```edits block in the proposal"
