"""prompt.skill.timeout_s bounds a whole endpoint request: an endpoint trickling its answer cannot hold a rank."""
import json
import socket
import threading
import time

import pytest

from esopt_mp.prompt.proposers import EndpointProposer

BODY = json.dumps({"choices": [{"message": {"content": "late"}}]}).encode()
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY)
GAP_S = 0.5  # one byte every GAP_S: each read waits well under the timeout, the whole answer takes ~GAP_S * len


def _trickler(srv: socket.socket, at_once: bytes, trickled: bytes, sent: list):
    conn, _ = srv.accept()
    with conn:
        conn.settimeout(5)
        conn.recv(65536)  # the request
        try:
            conn.sendall(at_once)
            for b in trickled:  # bounded: ends with the data, or when the client has gone
                conn.sendall(bytes([b]))
                sent.append(b)
                time.sleep(GAP_S)
        except OSError:
            pass


@pytest.mark.parametrize("phase", ["body", "headers"])
def test_a_trickling_endpoint_fails_the_request_at_its_deadline(phase):
    at_once, trickled = (HEAD, BODY) if phase == "body" else (b"", HEAD + BODY)
    srv = socket.create_server(("127.0.0.1", 0))
    sent: list = []
    server = threading.Thread(target=_trickler, args=(srv, at_once, trickled, sent), daemon=True)
    server.start()
    timeout = 1.0
    p = EndpointProposer(f"http://127.0.0.1:{srv.getsockname()[1]}", "m", key_env="", timeout_s=timeout)
    t = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=r"prompt\.skill\.timeout_s=1 s"):
            p("propose", 1)
        seconds = time.monotonic() - t
    finally:
        server.join(10)
        srv.close()
    assert GAP_S * len(trickled) > 20  # the trickle alone would take this long
    assert seconds < timeout + 5.0  # the deadline plus a generous margin, far from the trickle's end
    assert len(sent) < len(trickled)  # the client hung up mid-trickle


def test_a_resolver_that_never_answers_is_inside_the_deadline(monkeypatch):
    """Name resolution comes before any socket the deadline can shut: a dead nameserver (its getaddrinfo held
    until the test releases it) still ends the request at the deadline, not when the resolver gives up."""
    release = threading.Event()
    real = socket.getaddrinfo

    def stuck(host, *a, **k):
        release.wait(120)
        return real("127.0.0.1", *a, **k)

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    p = EndpointProposer("http://skill.invalid:9/v1", "m", key_env="", timeout_s=1.0)
    try:
        with pytest.raises(TimeoutError, match=r"prompt\.skill\.timeout_s=1 s"):
            p("propose", 1)
        assert not release.is_set()  # it returned while the resolver was still waiting: the deadline ended it
    finally:
        release.set()
