"""The endpoint's limits, which keep a client from stalling or exhausting the trainer that hosts it: the key is
checked before a body is read, a body over ``max_body_bytes`` is a 413 (declared or streamed), a message too long
for the context is refused by its length before it is tokenised, and tokenising never runs on the serving thread;
a non-loopback host needs a key or an explicit opt-in; connections past ``max_connections`` are refused (one warning),
one that does not send a whole request within ``request_timeout_s`` is closed, and accept() failures are logged once.
Socket timeouts here only keep a failing test from hanging."""
import errno
import json
import logging
import socket
import threading
import time

import pytest
from transformers import AutoTokenizer

from esopt_mp.endpoint.config import EndpointConfig, EndpointError
from esopt_mp.endpoint.server import EndpointServer
from esopt_mp.typed import ConfigError
from tests.unit.endpoint.test_endpoint_server import AGENT, FakeEngine, chat, httpx, serving

OK = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(AGENT)


def _addr(server):
    host, port = server.url.split("//")[1].rsplit(":", 1)
    return host, int(port)


def _raw(server, data: bytes, timeout: float = 30.0) -> socket.socket:
    s = socket.create_connection(_addr(server), timeout=timeout)
    if data:
        s.sendall(data)
    return s


def _read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails the test)."""
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def _response(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _reply(s: socket.socket) -> tuple[int, dict]:
    """One response read off ``s`` (its headers, then Content-Length bytes), the connection left open."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += s.recv(65536)
    head, _, body = raw.partition(b"\r\n\r\n")
    length = int(next(v for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
                      if k.strip().lower() == b"content-length"))
    while len(body) < length:
        body += s.recv(65536)
    return int(head.split()[1]), json.loads(body)


def _post_head(path: str, length: int, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n"
            f"{extra}\r\n").encode()


def test_a_non_loopback_host_needs_a_key_or_an_explicit_opt_in():
    from esopt_mp.config import build_config

    for host in ("0.0.0.0", "::", "10.1.2.3", "gpu-node-7"):
        with pytest.raises(ConfigError) as e:
            build_config({"endpoint": {"host": host}})
        assert str(e.value) == (f"endpoint.host: {host} is not a loopback address (other machines may reach it): set "
                                "endpoint.api_key_env (a bearer key), or endpoint.allow_unauthenticated=true to "
                                "serve it without one")
        build_config({"endpoint": {"host": host, "api_key_env": "ESOPT_ENDPOINT_KEY"}})
        build_config({"endpoint": {"host": host, "allow_unauthenticated": True}})
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost", "LOCALHOST"):
        EndpointConfig(host=host).validate()
    for key, bad in (("max_body_bytes", 0), ("max_connections", 0), ("request_timeout_s", 0.0),
                     ("request_timeout_s", float("inf"))):
        with pytest.raises(ConfigError, match=f"endpoint.{key}: must be"):
            build_config({"endpoint": {key: bad}})


def test_the_key_is_checked_before_the_body_is_read(tok, monkeypatch):
    """A stranger declaring a huge body gets its 401 at once: the server waits for none of it."""
    monkeypatch.setenv("ESOPT_ENDPOINT_KEY", "s3cret")
    with EndpointServer(EndpointConfig(api_key_env="ESOPT_ENDPOINT_KEY"), tok) as s:
        with serving(s, FakeEngine(tok)) as m:
            path = m.routes[0].base_url.split(s.url, 1)[1] + "/chat/completions"
            with _raw(s, _post_head(path, 200 * 2**20) + b'{"model": ') as c:
                status, body = _reply(c)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_a_body_over_the_cap_is_a_413_declared_or_streamed(tok):
    cap = 2000
    with EndpointServer(EndpointConfig(batch_window_s=0.05, max_body_bytes=cap), tok) as s:
        with serving(s, FakeEngine(tok)) as m:
            url = m.routes[0].base_url
            big = json.dumps({"model": "member-0-0", "messages": [{"role": "user", "content": "y" * 3 * cap}]})

            def chunks():  # no Content-Length: sent chunked, refused once past the cap
                for k in range(0, len(big), 500):
                    yield big[k:k + 500].encode()

            for content in (big, chunks()):
                r = httpx.post(f"{url}/chat/completions", content=content, timeout=30)
                assert r.status_code == 413, r.text
                assert r.json() == {"error": {"message": f"the request body is over {cap} bytes "
                                                         "(endpoint.max_body_bytes)", "type": "invalid_request_error",
                                              "param": None, "code": "request_too_large"}}
            path = url.split(s.url, 1)[1] + "/chat/completions"
            with _raw(s, _post_head(path, 100 * 2**20)) as c:  # declared: refused before a byte of it is sent
                assert _reply(c)[0] == 413
            r = chat(url, "member-0-0", [{"role": "user", "content": "y" * (cap // 2)}])
            assert r.status_code == 200 and m.routes[0].calls == 1


class RecordingTokenizer:
    """The tokenizer, recording each ``encode``: the thread it ran on and the text's length."""

    def __init__(self, tok):
        self._tok, self.calls = tok, []

    def encode(self, text, **kw):
        self.calls.append((threading.get_ident(), len(text)))
        return self._tok.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


class ThreadEngine(FakeEngine):
    """Records the threads it generates on: the serving thread."""

    def __init__(self, tok):
        super().__init__(tok)
        self.threads = set()

    def generate(self, convs, new_ids, params, max_new=None):
        self.threads.add(threading.get_ident())
        return super().generate(convs, new_ids, params, max_new)


def test_an_overlong_message_is_refused_untokenised_and_tokenising_leaves_the_serving_thread(tok):
    rec = RecordingTokenizer(tok)
    engine = ThreadEngine(tok)
    engine.max_context = 64
    with EndpointServer(EndpointConfig(batch_window_s=0.05), rec) as s:
        with serving(s, engine) as m:
            url = m.routes[0].base_url
            r = chat(url, "member-0-0", [{"role": "user", "content": "word " * 20_000}])
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
            assert err["message"].startswith("messages: this conversation is at least ")
            assert err["message"].endswith(" tokens; the model takes at most 64 (prompt and reply)")
            assert all(n < 20_000 for _, n in rec.calls)  # the long text was never tokenised
            assert m.routes[0].records[-1]["error"] == err["message"]  # recorded for its episode
            r = chat(url, "member-0-0", OK)  # the member goes on
            assert r.status_code == 200
    assert rec.calls and engine.threads
    assert not {ident for ident, _ in rec.calls} & engine.threads  # never tokenised on the serving thread


def test_connections_past_the_cap_are_refused_with_one_warning(tok, caplog):
    cfg = EndpointConfig(batch_window_s=0.05, max_connections=4)
    with EndpointServer(cfg, tok) as s, caplog.at_level(logging.WARNING, logger="esopt_mp.endpoint.guard"):
        idle = [_raw(s, b"") for _ in range(4)]
        deadline = time.monotonic() + 30
        while len(s._uv.server_state.connections) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(s._uv.server_state.connections) == 4
        for _ in range(3):
            with _raw(s, b"") as c:
                status, body = _response(_read_all(c))  # answered and closed, never kept
            assert status == 503 and body["error"]["code"] == "too_many_connections"
            assert "endpoint.max_connections" in body["error"]["message"]
        warnings = [r for r in caplog.records if r.name == "esopt_mp.endpoint.guard"]
        assert len(warnings) == 1
        assert "4 connections open (endpoint.max_connections)" in warnings[0].getMessage()
        for c in idle:
            c.close()
        with serving(s, FakeEngine(tok)) as m:  # room again once they close
            deadline = time.monotonic() + 30
            while len(s._uv.server_state.connections) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert chat(m.routes[0].base_url, "member-0-0", OK).status_code == 200


class SlowEngine(FakeEngine):
    def generate(self, convs, new_ids, params, max_new=None):
        time.sleep(2.0)  # a reply taking longer than request_timeout_s: its connection stays open
        return super().generate(convs, new_ids, params, max_new)


def test_a_connection_that_sends_no_whole_request_in_time_is_closed(tok):
    """Silent, half a header, half a body: each is closed after request_timeout_s; a whole request whose reply
    takes longer is answered, and its kept-alive connection serves a second."""
    with EndpointServer(EndpointConfig(batch_window_s=0.05, request_timeout_s=1.0), tok) as s:
        with serving(s, SlowEngine(tok)) as m:
            path = m.routes[0].base_url.split(s.url, 1)[1] + "/chat/completions"
            for data in (b"", b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n", _post_head(path, 100) + b"{"):
                with _raw(s, data) as c:
                    assert _read_all(c) == b""  # closed by the server (were it not, the recv timeout fails the test)
            with httpx.Client(timeout=30) as client:
                for _ in range(2):
                    r = client.post(f"{m.routes[0].base_url}/chat/completions",
                                    json={"model": "member-0-0", "messages": OK})
                    assert r.status_code == 200


def test_accept_out_of_descriptors_is_one_line_and_other_loop_errors_pass_through(caplog):
    from esopt_mp.endpoint.guard import Guard

    class Loop:
        def __init__(self):
            self.passed = []

        def default_exception_handler(self, context):
            self.passed.append(context)

    g, loop = Guard(4, 1.0, "http://127.0.0.1:1"), Loop()
    with caplog.at_level(logging.WARNING, logger="esopt_mp.endpoint.guard"):
        for _ in range(1000):
            g.loop_error(loop, {"message": "socket.accept() out of system resource",
                                "exception": OSError(errno.EMFILE, "Too many open files")})
    lines = [r.getMessage() for r in caplog.records if r.name == "esopt_mp.endpoint.guard"]
    assert len(lines) == 1 and "Too many open files" in lines[0] and not caplog.records[0].exc_info
    other = {"message": "Task exception was never retrieved", "exception": ValueError("x")}
    g.loop_error(loop, other)
    assert loop.passed == [other]


def test_max_connections_must_leave_the_run_its_file_descriptors(tok):
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        pytest.skip("no file-descriptor limit here")
    with pytest.raises(EndpointError) as e:
        EndpointServer(EndpointConfig(max_connections=soft), tok).start()
    assert str(e.value).startswith(f"endpoint.max_connections={soft}: this process may open only {soft} files")


class HoldingTokenizer(RecordingTokenizer):
    """Holds ``encode`` of a text containing ``mark`` until ``release`` is set (``entered`` counts them)."""

    def __init__(self, tok, mark: str):
        super().__init__(tok)
        self.mark, self.release, self.entered = mark, threading.Event(), threading.Semaphore(0)

    def encode(self, text, **kw):
        if self.mark in text:
            self.entered.release()
            assert self.release.wait(60)
        return super().encode(text, **kw)


def test_long_requests_being_tokenised_never_hold_up_a_short_one(tok):
    """Five long requests (over 64 KiB) held in tokenising: a short request of another episode is answered
    meanwhile, and the long ones after."""
    hold = HoldingTokenizer(tok, "LONG")
    with EndpointServer(EndpointConfig(batch_window_s=0.05), hold) as s:
        with serving(s, FakeEngine(tok), seeds=range(6)) as m:
            done = []
            long_text = [{"role": "user", "content": "LONG " + "word " * 20_000}]
            threads = [threading.Thread(target=lambda k=k: done.append(chat(m.routes[k].base_url, "member-0-0",
                                                                            long_text).status_code))
                       for k in range(1, 6)]
            for t in threads:
                t.start()
            assert hold.entered.acquire(timeout=60)  # the first long one is being tokenised, the others wait
            r = chat(m.routes[0].base_url, "member-0-0", OK)
            assert r.status_code == 200 and done == []
            hold.release.set()
            for t in threads:
                t.join(60)
            assert done == [200] * 5


def test_a_request_tokenised_while_its_member_closes_is_refused_not_queued(tok):
    """The gate: a request whose tokenising outlasts its member is refused (404, its evaluation ended), never
    queued for whichever member is served next, and the client is answered (no hang)."""
    hold = HoldingTokenizer(tok, "RACE")
    eng = FakeEngine(tok)
    got = []
    with EndpointServer(EndpointConfig(batch_window_s=0.05), hold) as s:
        with serving(s, eng) as m:
            url = m.routes[0].base_url
            t = threading.Thread(target=lambda: got.append(chat(url, "member-0-0", [{"role": "user",
                                                                                      "content": "RACE"}])))
            t.start()
            assert hold.entered.acquire(timeout=60)
        eng.version = 1
        with serving(s, eng, model="member-0-1"):  # the next member: never answers the held request
            hold.release.set()
            t.join(60)
            assert not t.is_alive()
        (r,) = got
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert eng.batches == []  # nothing was generated for it, by either member


def test_a_host_that_cannot_be_bound_is_one_line(tok):
    with pytest.raises(EndpointError, match=r"^endpoint.host='127.0.0.1 ': not an address this machine can bind"):
        EndpointServer(EndpointConfig(host="127.0.0.1 "), tok).start()
