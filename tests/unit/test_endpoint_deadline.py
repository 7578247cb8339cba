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
