"""A proposer on a separate OpenAI-compatible endpoint (``prompt.skill.proposer=endpoint``).

``POST {url}/v1/chat/completions`` (``url`` may already end in ``/v1``) with the key read from the environment
variable ``prompt.skill.key_env`` at call time, through the standard library (proxies from the environment as
``urllib`` reads them); nothing is contacted before the first proposal. ``timeout_s`` is a deadline for the whole
request, name resolution to last byte: a socket timeout alone bounds each read, and an endpoint that trickles its answer
would hold the rank for as long as it trickles. The request carries the proposal's seed; whether the endpoint
honours it (and so replays) is the endpoint's affair: the ledger stores every context version, so a replay reads
the skill rather than asking again.
"""
from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
import urllib.request


class _Deadline:
    """Shuts the request's socket down ``seconds`` after the start, which ends any read still waiting on it."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.expired = False
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return max(self.end - time.monotonic(), 1e-3)

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.append(sock)
            expired = self.expired
        if expired:
            _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            socks = list(self._socks)
        for sock in socks:
            _shut(sock)

    def cancel(self) -> None:
        self._timer.cancel()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


def _opener(deadline: _Deadline) -> urllib.request.OpenerDirector:
    """urllib's opener whose HTTP(S) connections wait at most the time left and hand their socket to ``deadline``."""
    def watched(base):
        class Connection(base):
            def connect(self):
                self.timeout = deadline.left()  # the connect (and a TLS handshake) wait at most the time left
                super().connect()
                deadline.watch(self.sock)

        return Connection

    class HTTP(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(watched(http.client.HTTPConnection), req)

    class HTTPS(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(watched(http.client.HTTPSConnection), req, context=self._context)

    return urllib.request.build_opener(HTTP, HTTPS)


class EndpointProposer:
    def __init__(self, url: str, model: str, key_env: str = "OPENAI_API_KEY", max_tokens: int = 512,
                 temperature: float = 0.7, timeout_s: float = 120.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"prompt.skill.url must be an http(s) URL, got {url!r}")
        self.base = url.rstrip("/") if url.rstrip("/").endswith("/v1") else url.rstrip("/") + "/v1"
        self.model, self.key_env = model, key_env
        self.max_tokens, self.temperature, self.timeout_s = max_tokens, temperature, timeout_s

    def _key(self) -> str:
        return os.environ.get(self.key_env, "") if self.key_env else ""

    def __call__(self, prompt: str, seed: int) -> str:
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": prompt}],
                           "max_tokens": self.max_tokens, "temperature": self.temperature,
                           "seed": seed % (1 << 31)}).encode()
        headers = {"Content-Type": "application/json"}
        if self._key():
            headers["Authorization"] = f"Bearer {self._key()}"
        req = urllib.request.Request(f"{self.base}/chat/completions", data=body, headers=headers, method="POST")
        deadline = _Deadline(self.timeout_s)
        done: dict = {}

        def fetch():  # on its own thread: name resolution and a proxy's reply come before any socket to shut
            try:
                with _opener(deadline).open(req, timeout=self.timeout_s) as resp:
                    done["raw"] = resp.read()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done["error"] = e

        worker = threading.Thread(target=fetch, daemon=True, name="esopt-skill-endpoint")
        worker.start()
        worker.join(self.timeout_s + 1.0)  # the deadline shut the sockets by then; DNS may still be waiting
        deadline.cancel()
        if worker.is_alive() or deadline.expired or isinstance(done.get("error"), TimeoutError):
            raise TimeoutError(f"prompt.skill.url: no complete answer within prompt.skill.timeout_s="
                               f"{self.timeout_s:g} s") from done.get("error")
        if "error" in done:
            raise done["error"]
        raw = done["raw"]
        data = json.loads(raw.decode())
        try:
            return data["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"prompt.skill.url: no choices[0].message.content in the answer: {str(data)[:200]}") \
                from None
