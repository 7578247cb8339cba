"""The endpoint's connection limits, so no client can exhaust the trainer that hosts it.

The trainer's file descriptors are shared with its checkpoints, harness processes and NCCL: each open connection
holds one. So connections past ``endpoint.max_connections`` are answered 503 and closed at once; a connection must
send a whole request (headers and body) within ``endpoint.request_timeout_s`` of opening or of its previous reply;
after an early reply (401, 413) the rest of a body is read and dropped, within :data:`DRAIN_BYTES`, so the client
reads the reply; and a flood is logged in one line, not a traceback per connection (asyncio reports each failed
``accept()`` when the process is out of descriptors).

Imported when a server starts (uvicorn is an optional dependency). The protocol is uvicorn's h11 one (h11 comes
with uvicorn; ``http="auto"`` would pick httptools when installed) with these guards added.
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

DRAIN_BYTES = 64 * 1024 * 1024  # a body still arriving after its early reply: read (and dropped) up to this
_OUT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def _busy_response(max_connections: int) -> bytes:
    body = json.dumps({"error": {"message": f"the endpoint has {max_connections} connections open "
                                            "(endpoint.max_connections); retry later", "type": "server_error",
                                 "param": None, "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class Guard:
    """One server's limits and what it has logged (used on the server's event loop only)."""

    def __init__(self, max_connections: int, timeout_s: float, where: str):
        self.max_connections, self.timeout_s, self.where = max_connections, timeout_s, where
        self.busy = _busy_response(max_connections)
        self.refused = 0  # connections refused over the cap, in all
        self.flooded = False  # at the cap since the last warning
        self.accept_logged = -math.inf

    def refuse(self) -> None:
        self.refused += 1
        if not self.flooded:
            self.flooded = True
            log.warning("endpoint %s: %d connections open (endpoint.max_connections); refusing new ones (503) until "
                        "some close", self.where, self.max_connections)

    def closed(self, open_now: int) -> None:
        if self.flooded and open_now <= self.max_connections // 2:  # the flood is over: a next one is logged
            self.flooded = False

    def loop_error(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """The loop's exception handler: ``accept()`` out of descriptors (retried each second) in one line a minute,
        anything else as asyncio logs it."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _OUT_OF and "accept" in str(context.get("message", "")):
            now = time.monotonic()
            if now - self.accept_logged >= 60:
                self.accept_logged = now
                log.warning("endpoint %s: cannot accept connections (%s); the process is out of file descriptors "
                            "or memory (ulimit -n); retrying, not logged again for a minute", self.where,
                            exc.strerror or exc)
            return
        loop.default_exception_handler(context)


def protocol(guard: Guard) -> type:
    """uvicorn's h11 protocol with ``guard``'s connection cap, request deadline and bounded drain."""

    class GuardedH11(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _refused = False
        _dropped = 0

        def connection_made(self, transport) -> None:  # type: ignore[override]
            if len(self.server_state.connections) >= guard.max_connections:
                self._refused, self.transport = True, transport
                guard.refuse()
                transport.write(guard.busy)
                transport.close()
                return
            super().connection_made(transport)
            self._follow()

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._refused:
                return
            super().connection_lost(exc)
            guard.closed(len(self.server_state.connections))

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self.conn.our_state in (h11.DONE, h11.MUST_CLOSE) and self.conn.their_state is h11.SEND_BODY:
                self._dropped += len(data)  # replied before the body was read: uvicorn drops the rest, within bounds
                if self._dropped > DRAIN_BYTES:
                    self.transport.close()
                    return
            super().data_received(data)
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._follow()

        def _follow(self) -> None:
            """The deadline runs while the client owes a request (its start or its rest), from the connection's
            opening or its previous reply; it stops once a request is whole (its reply may take minutes)."""
            owed = self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing()
            if not owed:
                self._disarm()
            elif self._deadline is None:
                self._deadline = self.loop.call_later(guard.timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _timed_out(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedH11


class GuardedServer(uvicorn.Server):
    """uvicorn's server with ``guard``'s loop exception handler."""

    def __init__(self, config: uvicorn.Config, guard: Guard):
        super().__init__(config)
        self.guard = guard

    async def startup(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(self.guard.loop_error)
        await super().startup(sockets=sockets)
