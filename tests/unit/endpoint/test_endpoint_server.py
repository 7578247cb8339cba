"""The endpoint's server on loopback in a thread (port 0): the OpenAI wire format (plain and streamed, tools in and
tool calls out, usage, models), its refusals (key, model, body, port), lockstep batches, and requests racing a
restore: every answer comes from the member its request named, every other request is refused, none hangs."""
import contextlib
import json
import os
import socket
import threading
import time
import types

import pytest

try:
    import httpx
except ImportError:  # openai 3 brings httpx2, the same API under another name
    import httpx2 as httpx
from transformers import AutoTokenizer

from esopt_mp.endpoint.config import EndpointConfig, EndpointError
from esopt_mp.endpoint.render import continuation_text, prompt_text
from esopt_mp.endpoint.server import EndpointServer
from esopt_mp.core.types import Generation
from esopt_mp.engine.base import EngineStats, SamplingParams

AGENT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "esopt_mp", "assets", "tiny_agent")
SAMPLING = SamplingParams(temperature=0, presence_penalty=0.0, max_new_tokens=64)
GREEDY16 = SamplingParams(temperature=0, presence_penalty=0.0, max_new_tokens=16)
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


class FakeEngine:
    """Replies name the weights' ``version`` and the conversation's seed; a prompt ending in CALL gets a tool call.
    It records every batch's new token ids (what a turn prefilled)."""

    def __init__(self, tok):
        self.tokenizer, self.pad_id, self.stats = tok, 0, EngineStats()
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")
        self.version, self.batches = 0, []

    def new_conversation(self, cid, seed):
        return types.SimpleNamespace(ids=[], seed=seed)

    def generate(self, convs, new_ids, params, max_new=None):
        self.batches.append([list(ids) for ids in new_ids])
        out = []
        for k, (c, ids) in enumerate(zip(convs, new_ids)):
            asked = self.tokenizer.decode(ids)
            text = CALL if "CALL" in asked else f"v{self.version} seed {c.seed % 1000} at {len(c.ids)}"
            toks = self.tokenizer.encode(text, add_special_tokens=False)
            cap = params.max_new_tokens if max_new is None else max_new[k]
            finish = "length" if len(toks) >= cap else "eos"
            toks = toks[:cap] if finish == "length" else toks + [self.im_end]
            c.ids += list(ids) + toks
            out.append(Generation(toks, self.tokenizer.decode([t for t in toks if t != self.im_end]), finish,
                                  len(ids), 0.0))
        return out

    def close(self):
        pass


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(AGENT)


@pytest.fixture(scope="module")
def server(tok):
    with EndpointServer(EndpointConfig(batch_window_s=0.05), tok) as s:
        yield s


@contextlib.contextmanager
def serving(server, engine, model="member-0-0", seeds=(11, 12), live=None, sampling=SAMPLING):
    """A member served by a background thread (the trainer serves on its own thread; the test is the client)."""
    stop = threading.Event()
    with server.member(model, list(seeds), sampling) as m:
        th = threading.Thread(target=m.serve, args=(engine,), kwargs={"live": live, "until": stop.is_set},
                              daemon=True)
        th.start()
        try:
            yield m
        finally:
            stop.set()
            th.join(10)
            assert not th.is_alive()


def chat(url, model, messages, **kw):
    return httpx.post(f"{url}/chat/completions", json={"model": model, "messages": messages, **kw}, timeout=30)


def test_models_and_a_two_turn_chat_with_usage_and_the_delta_only(server, tok):
    eng = FakeEngine(tok)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hello"}]
    with serving(server, eng) as m:
        url = m.routes[1].base_url
        assert httpx.get(f"{url}/models").json()["data"][0]["id"] == "member-0-0"
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "member-0-0"
        r = chat(url, "member-0-0", msgs).json()
        first = tok.encode(prompt_text(msgs, None), add_special_tokens=False)
        assert r["object"] == "chat.completion" and r["model"] == "member-0-0"
        assert r["choices"][0]["message"]["content"] == "v0 seed 12 at 0"  # episode 1's seed, its first conversation
        assert r["choices"][0]["finish_reason"] == "stop" and eng.batches[-1] == [first]
        u = r["usage"]
        assert u["prompt_tokens"] == len(first) and u["prompt_tokens_details"]["cached_tokens"] == 0
        assert u["completion_tokens"] == len(tok.encode("v0 seed 12 at 0")) + 1  # and <|im_end|>
        more = msgs + [r["choices"][0]["message"], {"role": "user", "content": "again"}]
        r2 = chat(url, "member-0-0", more, max_tokens=3).json()
        delta = tok.encode(continuation_text(True, more[-1:]), add_special_tokens=False)
        assert eng.batches[-1] == [delta]  # only the new message and the generation prompt were prefilled
        assert r2["usage"]["prompt_tokens"] == u["prompt_tokens"] + u["completion_tokens"] + len(delta)
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        assert r2["usage"]["completion_tokens"] == 3 and r2["choices"][0]["finish_reason"] == "length"
        recs = m.routes[1].records
        assert m.routes[1].calls == 2 and [x["continued"] for x in recs] == [False, True]
        assert recs[1]["reply"] == r2["choices"][0]["message"] and recs[1]["usage"] == r2["usage"]
        assert m.routes[0].calls == 0


def test_streaming_sends_role_content_finish_usage_and_done(server, tok):
    with serving(server, FakeEngine(tok)) as m:
        body = {"model": "member-0-0", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{m.routes[0].base_url}/chat/completions", json=body, timeout=30) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "v0 seed 11 at 0"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_the_official_client_plain_and_streamed_with_tools(server, tok):
    import openai

    eng = FakeEngine(tok)
    with serving(server, eng, model="member-2-5") as m:
        client = openai.OpenAI(base_url=m.routes[0].base_url, api_key="none", max_retries=0)
        msgs = [{"role": "user", "content": "add please CALL"}]
        r = client.chat.completions.create(model="member-2-5", messages=msgs, tools=TOOLS)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
        assert msg.tool_calls[0].function.name == "add" and json.loads(msg.tool_calls[0].function.arguments) == \
            {"a": 1, "b": 2}
        follow = msgs + [msg.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "3"}]
        r2 = client.chat.completions.create(model="member-2-5", messages=follow, tools=TOOLS)
        assert r2.choices[0].message.content.startswith("v0 seed 11") and r2.usage.prompt_tokens_details.cached_tokens
        assert m.routes[0].records[1]["continued"]  # the echoed tool call matched the reply returned
        assert eng.batches[-1] == [tok.encode(continuation_text(True, follow[-1:]), add_special_tokens=False)]
        stream = client.chat.completions.create(model="member-2-5", messages=[{"role": "user", "content": "CALL"}],
                                                tools=TOOLS, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert calls[0].function.name == "add" and json.loads(calls[0].function.arguments) == {"a": 1, "b": 2}
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert chunks[-1].usage.completion_tokens > 0
        plain = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        assert [x.id for x in plain.models.list()] == ["member-2-5"]
        with pytest.raises(openai.NotFoundError) as e:
            plain.chat.completions.create(model="member-9-9", messages=msgs)
        assert e.value.code == "model_not_found" and "member-9-9" in e.value.message


def test_refusals_are_openai_errors_naming_the_parameter(server, tok):
    with serving(server, FakeEngine(tok)) as m:
        url = m.routes[0].base_url
        ok = [{"role": "user", "content": "x"}]
        cases = [(b"{not json", None), (json.dumps({"model": "member-0-0"}), "messages"),
                 (json.dumps({"messages": ok}), "model"),
                 (json.dumps({"model": "member-0-0", "messages": ok, "n": 2}), "n"),
                 (json.dumps({"model": "member-0-0", "messages": ok, "max_tokens": 0}), "max_tokens"),
                 (json.dumps({"model": "member-0-0", "messages": [{"role": "robot", "content": "x"}]}),
                  "messages[0].role"),
                 (json.dumps({"model": "member-0-0", "messages": [{"role": "user", "content": [
                     {"type": "image_url", "image_url": {"url": "x"}}]}]}), "messages[0].content[0]"),
                 (json.dumps({"model": "member-0-0", "messages": ok, "n": True}), "n"),  # True == 1 in Python
                 (json.dumps({"model": "member-0-0", "messages": ok,
                              "tools": [{"type": "function", "function": "calc"}]}), "tools[0]"),
                 ('{"model": "member-0-0", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}", None)]
        for body, param in cases:
            r = httpx.post(f"{url}/chat/completions", content=body, timeout=30)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
        r = chat(url, "member-1-1", ok)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["param"] == "model"
        assert httpx.get(f"{server.url}/v2/nothing").json()["error"]["message"].startswith("GET /v2/nothing")
        assert m.routes[0].calls == 0
    r = chat(url, "member-0-0", ok)  # the member's evaluation ended: its route refuses
    assert r.status_code == 404 and "the member's evaluation ended" in r.json()["error"]["message"]
    r = chat(f"{server.url}/v1", "member-0-0", ok)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_bearer_key_is_required_when_configured(tok, monkeypatch):
    monkeypatch.setenv("ESOPT_ENDPOINT_KEY", "s3cret")
    with EndpointServer(EndpointConfig(api_key_env="ESOPT_ENDPOINT_KEY"), tok) as s:
        assert s.api_key == "s3cret"
        with serving(s, FakeEngine(tok)) as m:
            url, ok = m.routes[0].base_url, [{"role": "user", "content": "x"}]
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                            {"Authorization": "Basic s3cret"}):
                r = httpx.post(f"{url}/chat/completions", json={"model": "member-0-0", "messages": ok},
                               headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(f"{url}/models").status_code == 401
            for scheme in ("Bearer", "bearer"):  # the scheme is case-insensitive (RFC 9110)
                r = httpx.post(f"{url}/chat/completions", json={"model": "member-0-0", "messages": ok},
                               headers={"Authorization": f"{scheme} s3cret"}, timeout=30)
                assert r.status_code == 200


def test_a_conversation_past_the_context_is_refused_and_the_member_goes_on(server, tok):
    """A prompt that would not fit the engine's context with one more token: a 400 naming it, never sent to the
    engine (vLLM raises there, which would end the run); the member's other requests are served."""
    engine = FakeEngine(tok)
    engine.max_context = 64
    with serving(server, engine) as m:
        url = m.routes[0].base_url
        r = chat(url, "member-0-0", [{"role": "user", "content": "word " * 200}])
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
        assert "the model takes at most 64" in err["message"]
        r = chat(url, "member-0-0", [{"role": "user", "content": "x"}])
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_port_in_use_is_one_line(tok):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(EndpointError) as e:
            EndpointServer(EndpointConfig(port=port), tok).start()
        with pytest.raises(EndpointError) as e1:
            EndpointServer(EndpointConfig(port=port - 1), tok, dp_rank=1).start()  # port + dp rank
    assert str(e.value) == f"endpoint.port={port}: 127.0.0.1:{port} is in use; choose another port or 0 for a free one"
    assert str(e1.value) == (f"endpoint.port={port - 1}: 127.0.0.1:{port} is in use (dp rank 1: endpoint.port + 1); "
                             "choose another port or 0 for a free one")


def test_a_batch_waits_for_every_live_episode_in_episode_order(server, tok):
    eng = FakeEngine(tok)
    out = {}
    with EndpointServer(EndpointConfig(batch_window_s=60.0), tok) as slow:  # only lockstep makes a batch here
        with serving(slow, eng, seeds=(1, 2, 3), live=lambda: 3) as m:

            def ask(k):
                out[k] = chat(m.routes[k].base_url, "member-0-0", [{"role": "user", "content": f"q{k}"}]).json()

            threads = [threading.Thread(target=ask, args=(k,)) for k in (2, 0, 1)]
            for t in threads:
                t.start()
                time.sleep(0.05)
            for t in threads:
                t.join(30)
    with serving(server, FakeEngine(tok), live=lambda: 5) as m:  # fewer requests than live episodes: the window
        assert chat(m.routes[0].base_url, "member-0-0", [{"role": "user", "content": "q"}]).status_code == 200
    assert [len(b) for b in eng.batches] == [3]  # one batch of all three live episodes
    assert eng.batches[0] == [tok.encode(prompt_text([{"role": "user", "content": f"q{k}"}], None),
                                         add_special_tokens=False) for k in range(3)]  # in episode order
    assert [out[k]["choices"][0]["message"]["content"] for k in range(3)] == [f"v0 seed {k + 1} at 0"
                                                                             for k in range(3)]


def test_requests_racing_a_restore_are_answered_by_their_own_member_or_refused(server, tok):
    """Clients keep asking for the member they last saw while members are opened, served and closed (their weights
    restored: the engine's version bumped). Every answer names the version of the model its request asked for."""
    eng = FakeEngine(tok)
    current = {"model": "member-0", "url": None}
    results, stop = [], threading.Event()

    def client(i):
        while not stop.is_set():
            model, url = current["model"], current["url"] or f"{server.url}/v1"
            r = chat(url, model, [{"role": "user", "content": f"client {i}"}])
            results.append((model, r.status_code, r.json()))

    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for t in clients:
        t.start()
    for v in range(4):
        eng.version = v  # the member's weights
        model = f"member-{v}"
        with server.member(model, [5, 6], SAMPLING) as m:
            current.update(model=model, url=m.routes[v % 2].base_url if v % 2 else None)
            t0 = time.monotonic()  # each member answers a few requests (bounded, should the machine stall)
            m.serve(eng, until=lambda: m.shared.calls + sum(r.calls for r in m.routes) >= 3 and
                    time.monotonic() > t0 + 0.1 or time.monotonic() > t0 + 60)
        eng.version = -1  # restored: whatever is answered now would name no member
        seen, t0 = len(results), time.monotonic()
        while len(results) < seen + 4 and time.monotonic() < t0 + 60:  # requests meet the closed gate meanwhile
            time.sleep(0.01)
    stop.set()
    for t in clients:
        t.join(30)
        assert not t.is_alive()  # none hangs
    answered = [(m, b) for m, s, b in results if s == 200]
    refused = [(m, s, b) for m, s, b in results if s != 200]
    assert {m for m, _ in answered} == {f"member-{v}" for v in range(4)} and refused
    for model, body in answered:
        assert body["model"] == model and body["choices"][0]["message"]["content"].startswith(f"v{model[7:]} ")
    for model, status, body in refused:
        assert status == 404 and body["error"]["code"] == "model_not_found" and model in body["error"]["message"]


def test_the_tiny_agent_through_the_endpoint_plain_and_streamed(server, tok):
    from transformers import AutoModelForCausalLM

    from esopt_mp.engine.hf import HFEngine

    engine = HFEngine(AutoModelForCausalLM.from_pretrained(AGENT).eval(), tok)
    msgs = [{"role": "system", "content": "Play 4x4 Sudoku."}, {"role": "user", "content": "1 . 3 4"}]
    conv = engine.new_conversation(0, 11)
    want = engine.generate([conv], [tok.encode(prompt_text(msgs, None), add_special_tokens=False)], GREEDY16)[0]
    with serving(server, engine, sampling=GREEDY16) as m:
        r = chat(m.routes[0].base_url, "member-0-0", msgs).json()
        body = {"model": "member-0-0", "messages": msgs, "stream": True}
        with httpx.stream("POST", f"{m.routes[0].base_url}/chat/completions", json=body, timeout=30) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert r["choices"][0]["message"]["content"] == want.text
    assert r["usage"]["completion_tokens"] == len(want.token_ids)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == want.text  # greedy: same text


def test_without_fastapi_a_server_fails_in_one_line_when_started(tok, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn raises ImportError
    server = EndpointServer(EndpointConfig(), tok)  # building the config and the object needs neither
    with pytest.raises(EndpointError) as e:
        server.start()
    assert str(e.value) == "the endpoint needs FastAPI and uvicorn: pip install 'esopt_mp[endpoint]'"


def test_an_ended_member_keeps_its_token_ids_and_lets_the_engine_state_go(server, tok):
    with serving(server, FakeEngine(tok)) as m:
        chat(m.routes[0].base_url, "member-0-0", [{"role": "user", "content": "x"}])
        held = list(m.routes[0].sessions.threads[0].conv.ids)
    t = m.routes[0].sessions.threads[0]
    assert t.conv is None and t.ids == held and len(held) > 0


def test_a_model_whose_template_is_not_chatml_is_refused_in_one_line():
    """The endpoint renders requests in ChatML and reads tool calls from it: a base model's plain template (or any
    other) would be prompted in a format it does not know, so it is refused before a port opens."""
    from esopt_mp.models.gguf import PLAIN_TEMPLATE

    other = AutoTokenizer.from_pretrained(AGENT)
    other.chat_template = PLAIN_TEMPLATE
    with pytest.raises(EndpointError, match=r"^the model's chat template is not ChatML, .* \(objective=agent\)$"):
        EndpointServer(EndpointConfig(), other)
