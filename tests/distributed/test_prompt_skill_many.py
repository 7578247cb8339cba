"""Skill synthesis with real edits through the multi-prompt path (``Proposer.many``) at dp=2 and tp=2: the policy's
real batch generation runs (TP peers follow it) but the leader answers canned per-batch edits, or an OpenAI-compatible
endpoint served by rank 0 answers them. Every rank ends with the same skill, the one a single process gets."""
import json
import os
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from esopt_mp.parallel.local_world import free_port, run_world
from tests.unit.prompt.test_prompt_skill import reply_json


def canned(prompt: str) -> str:
    """Edits that depend on the batch (the members it shows) and the skill it was shown."""
    members = sorted({int(m) for m in re.findall(r"### Episode \d+ \(member (\d+),", prompt)})
    lines = prompt.split("<skill>", 1)[1].split("</skill>", 1)[0].count("\n")
    edits = [{"op": "insert", "section": "Strategy", "text": f"- members {members} at {lines} lines"},
             {"op": "insert", "section": "Pitfalls", "text": "- reread the puzzle"}]  # every batch: merged once
    return "Edits:\n```edits\n" + "\n".join(json.dumps(e) for e in edits) + "\n```\n"


class Endpoint(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.paths.append(self.path)
        reply_json(self, {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                          "choices": [{"index": 0, "finish_reason": "stop", "message": {
                              "role": "assistant", "content": canned(body["messages"][0]["content"])}}]})

    def log_message(self, *a):
        pass


def _worker(rank, world, dp, tp, proposer, client, port, run_dir, out):
    import esopt_mp.agent.skill_hooks as skill
    from esopt_mp.agent.episodes import EpisodePlayer
    from esopt_mp.parallel import discover, init_distributed
    from esopt_mp.trainer import ESTrainer
    from tests.integration.test_prompt_skill_run import AnswerEnv, _cfg

    torch.set_num_threads(1)
    real, make, asked = skill.generate_texts, EpisodePlayer.make_env, []

    def generate(engine, messages, seeds, sampling):  # the real generation (peers follow it), canned answers
        real(engine, messages, seeds, sampling)
        asked.append(len(messages))
        return [canned(m[0]["content"]) for m in messages]

    srv, openai = None, sys.modules.get("openai", False)
    if proposer == "endpoint" and rank == 0:
        srv = ThreadingHTTPServer(("127.0.0.1", port), Endpoint)
        srv.paths = []
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    if client == "urllib":
        sys.modules["openai"] = None  # the urllib path even where openai is installed
    skill.generate_texts, EpisodePlayer.make_env = generate, lambda *a, **kw: AnswerEnv()
    try:  # the one-process run shares pytest's process: leave the modules as they were
        cfg = _cfg(run_dir)
        cfg.parallel.dp, cfg.parallel.tp = dp, tp
        if proposer == "endpoint":
            s = cfg.prompt.skill
            s.proposer, s.url, s.model, s.timeout_s = "endpoint", f"http://127.0.0.1:{port}", "canned", 20.0
        tr = ESTrainer(cfg, init_distributed(discover(), dp, tp))
        for t in range(2):
            tr.step(t)
        text = tr.context.text
        tr.close()
    finally:
        skill.generate_texts, EpisodePlayer.make_env = real, make
        if openai is False:
            sys.modules.pop("openai", None)
        else:
            sys.modules["openai"] = openai
        if srv is not None:
            srv.shutdown()
            srv.server_close()
    torch.save({"text": text, "asked": asked, "paths": srv.paths if srv else []}, f"{out}.{rank}")


def _ledger(run_dir):
    with open(os.path.join(run_dir, "history.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in ("wall_time", "sha256")} for line in f]


def _check(tmp_path, proposer, world_dp_tp):
    one, two = torch.load(tmp_path / "one.pt.0"), [torch.load(tmp_path / f"two.pt.{r}") for r in range(2)]
    a, b = _ledger(tmp_path / "one"), _ledger(tmp_path / "two")
    logs = [[json.loads(x) for x in open(tmp_path / d / "skill.jsonl")] for d in ("one", "two")]
    assert [g["text"] for g in two] == [one["text"], one["text"]]  # every rank: the one-process skill
    assert [e["context_next"] for e in a] == [e["context_next"] for e in b] and logs[0] == logs[1]
    assert [e["skill"] for e in a] == [e["skill"] for e in b] and [e["returns"] for e in a] == [e["returns"] for e in b]
    summary = []
    for e, rec in zip(a, logs[0]):  # skill.jsonl and the ledger agree; each step's edits were applied or rejected
        assert rec["step"] == e["step"] and {k: rec[k] for k in e["skill"]} == e["skill"]
        assert rec["batches"] == 2 and rec["proposed"] == 4 and rec["malformed"] == 0 and rec["evaluations"] == 2
        assert [d["reason"] for d in rec["left_out"]] == ["merged: same edit as batch 0"]
        assert sorted(x["text"].split(" at ")[0] for x in rec["edits"]) == ["- members [0, 1]", "- members [2, 3]",
                                                                             "- reread the puzzle"]
        failed = {(x["batch"], x["index"]) for x in rec["not_applied"]}
        added = [x["text"] for x in rec["edits"] if (x["batch"], x["index"]) not in failed]
        assert len(added) == rec["applied"] if rec["kept"] else rec["applied"] == 0
        if rec["kept"]:
            assert e["context_next"] == rec["candidate"] and all(t in rec["candidate_text"] for t in added)
        else:
            assert rec["decision"] == "rejected: held-out return lower" and e["context_next"] == e["context"]
        summary.append((e["step"], rec["decision"], rec["val_before"], rec["val_after"]))
    assert any(rec["kept"] for rec in logs[0]) and "- members [0, 1] at 7 lines" in one["text"]
    print(json.dumps({"proposer": proposer, "dp_tp": world_dp_tp, "steps": summary}))
    return one, two


@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2)])
def test_policy_many_with_real_edits_at_dp2_and_tp2_equals_one_process(tmp_path, dp, tp):
    _worker(0, 1, 1, 1, "policy", "urllib", 0, str(tmp_path / "one"), str(tmp_path / "one.pt"))
    run_world(2, _worker, dp, tp, "policy", "urllib", 0, str(tmp_path / "two"), str(tmp_path / "two.pt"), timeout=120)
    one, two = _check(tmp_path, "policy", [dp, tp])
    assert one["asked"] == [2, 2] and two[0]["asked"] == [2, 2] and two[1]["asked"] == []  # one leader, many()


@pytest.mark.parametrize("client", ["urllib", "openai"])
def test_endpoint_at_dp2_against_a_local_server_equals_one_process(tmp_path, client):
    if client == "openai":
        pytest.importorskip("openai")
    _worker(0, 1, 1, 1, "endpoint", client, free_port(), str(tmp_path / "one"), str(tmp_path / "one.pt"))
    run_world(2, _worker, 2, 1, "endpoint", client, free_port(), str(tmp_path / "two"), str(tmp_path / "two.pt"),
              timeout=120)
    one, two = _check(tmp_path, "endpoint", [2, 1])
    assert two[0]["paths"] == ["/v1/chat/completions"] * 4 and two[1]["paths"] == []  # rank 0 asks, 2 a step
    assert one["asked"] == two[0]["asked"] == two[1]["asked"] == []  # the policy generated nothing
