"""The endpoint: members served OpenAI-style on FastAPI + uvicorn (a daemon thread, no signals).

Requests are answered only while their member is being served: :meth:`EndpointServer.member` opens the gate for
one model id and closing it (its weights are about to be restored) refuses every waiting and later request with
an OpenAI ``model_not_found`` error; no request is ever answered by other weights. :meth:`EndpointServer.members`
serves several members at once, each under its own model id and routes, their requests generated in one batch
whose rows carry each member's slot (es.member_batch: the engine adds each row's member's low-rank terms, the
weights are never perturbed). The gate check and the enqueue
happen under the member's lock, which closing takes too. Generation runs on the thread that calls
:meth:`Member.serve` (the TP leader's, inside ``TPEngine.lead``); a request is tokenised before it is queued, on a
worker thread: short ones on a few threads, long ones (over :data:`LONG_BYTES`) one at a time on another, so a
long one never holds up the member's other episodes (only other long ones).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import errno
import hmac
import resource
import secrets
import socket
import threading
import time

from esopt_mp.chat.format import build_chat_format
from esopt_mp.endpoint.batcher import Batcher, Pending, encode_turn, generate, token_bound
from esopt_mp.endpoint.config import EndpointConfig, EndpointError
from esopt_mp.endpoint.protocol import (ENDED, RequestError, completion, models_list, not_served, parse_request,
                                        reply_message, request_cap, sse_chunks, usage)
from esopt_mp.endpoint.sessions import Sessions
from esopt_mp.engine.base import SamplingParams
from esopt_mp.engine.tp import replicated

_MISSING = "the endpoint needs FastAPI and uvicorn: pip install 'esopt_mp[endpoint]'"
ENCODERS = 4  # threads tokenising requests of up to LONG_BYTES at once
LONG_BYTES = 64 << 10  # a longer request body is tokenised on a thread of its own, one at a time


class Route:
    """Episode ``index``'s own base URL and what was asked of it."""

    def __init__(self, index: int, token: str, base_url: str, seed: int):
        self.index, self.token, self.base_url = index, token, base_url
        self.sessions = Sessions(seed)
        self.records: list[dict] = []  # every chat request and its reply (or error), in order
        self.calls = 0  # chat requests answered


class Member:
    """One member's gate, routes and waiting requests (made by :meth:`EndpointServer.member` or, several sharing one
    batcher, by :meth:`EndpointServer.members`).

    ``slot``: its member slot in the engine (-1: the engine's weights as they are); ``first``: its routes' first
    episode index in the batcher it shares (``shared``: that batcher's condition and batcher), so the batcher counts
    every member's episodes."""

    def __init__(self, server: "EndpointServer", model_id: str, seeds: list[int], sampling: SamplingParams,
                 slot: int = -1, first: int = 0, shared: tuple[threading.Condition, Batcher] | None = None):
        self.server, self.model_id, self.sampling, self.slot = server, model_id, sampling, slot
        base = server.url
        self.routes = [Route(first + k, secrets.token_urlsafe(12), f"{base}/e/{{}}/v1", s)
                       for k, s in enumerate(seeds)]
        for r in self.routes:
            r.base_url = r.base_url.format(r.token)
        self.cond, self.batcher = shared or (threading.Condition(), None)
        if self.batcher is None:
            self.batcher = Batcher(self.cond, server.cfg.batch_window_s, len(seeds))
        shared_seed = seeds[0] if seeds else 0  # the plain /v1 routes: conversations of their own stream, counted
        # after every episode of the batcher, one per member
        self.shared = Route(self.batcher.episodes + max(slot, 0), "", f"{base}/v1", shared_seed ^ 0x5EED)
        self.group = [self]  # the members sharing this batcher (serve() generates for all of them)
        self.closed = False
        self.limit: int | None = None  # the engine's context, once serve() has it (a request is checked against it)
        self._cid = 0

    def submit(self, route: Route, req: dict, session: str | None, deliver) -> None:
        """Enqueue a chat request (or refuse it: the gate is closed, it cannot fit the context); on a worker thread,
        which tokenises it."""
        tools = req.get("tools") or None
        with self.cond:
            if self.closed:
                raise not_served(req["model"], ENDED)
            thread, new, fresh = route.sessions.assign(session, req["messages"], tools)
            parse = bool(tools) and req.get("tool_choice") != "none"

            def done(result):  # under the lock, on the serving thread: the route's record, then the reply
                rec = {"session": session, "conversation": thread.ordinal, "continued": not fresh,
                       "messages": req["messages"], "tools": tools, "seconds": time.perf_counter() - p.arrived}
                if isinstance(result, RequestError):
                    thread.busy, thread.dead = False, True
                    rec["error"] = str(result)
                else:
                    Sessions.record(thread, req["messages"], reply_message(result), result.ended_clean)
                    rec.update(reply=reply_message(result), finish=result.finish_reason, usage=usage(result))
                    route.calls += 1
                route.records.append(rec)
                deliver(result)

            p = Pending(route.index, thread, req["messages"], new, fresh, tools, parse, request_cap(req),
                        time.perf_counter(), done, member=self.slot)
            n0 = 0 if fresh else len(thread.conv.ids)
        tok = self.server.tokenizer
        try:
            ids = None if tok is None else encode_turn(tok, p, n0, self.limit, self.server.token_bound)
        except Exception as e:  # noqa: BLE001 - the request's error, not the member's
            ids = RequestError(500, f"tokenising the request failed: {type(e).__name__}: {e}", kind="server_error")
        with self.cond:
            if isinstance(ids, RequestError):
                p.deliver(ids)
            elif self.closed:
                p.deliver(not_served(self.model_id, ENDED))
            else:
                p.ids = ids
                self.batcher.put(p)

    def _next_cid(self) -> int:
        self._cid += 1
        return self._cid

    def serve(self, engine, live=None, until=None, poll_s: float = 0.05) -> None:
        """Generate this member's requests (and those of the members sharing its batcher) on the calling thread until
        ``until()`` is true.

        ``live()``: how many episodes are running (a batch waits, at most ``batch_window_s``, for a request of
        each); ``engine``: the member's (a :class:`~esopt_mp.engine.tp.TPEngine` at tp > 1: call this inside its
        ``lead``). A generation that raises answers its batch with a server error and raises here."""
        if until is None:
            raise TypeError("Member.serve needs until=: a callable saying when the member's episodes are done")
        engine = replicated(engine)
        for m in self.group:
            m.limit = getattr(engine, "max_context", None)
        while True:
            done, n = until(), (live() if live is not None else 0)
            with self.cond:
                if done or all(m.closed for m in self.group):
                    return
                batch = self.batcher.take(n, time.perf_counter())
                if batch is None:
                    self.cond.wait(self.batcher.wait_s(time.perf_counter(), poll_s))
                    continue
            try:
                turns = generate(engine, batch, self.sampling, self.server.cfg.tool_parser, self._next_cid,
                                 self.server.tokenizer)
            except BaseException as e:
                err = RequestError(500, f"generation failed: {type(e).__name__}: {e}", kind="server_error")
                with self.cond:
                    for p in batch:
                        p.deliver(err)
                raise
            with self.cond:
                for p, t in zip(batch, turns):
                    p.deliver(t)

    def _close(self) -> None:
        """Refuse what waits; the conversations keep their token ids and let the engine's state (KV) go."""
        with self.cond:
            self.closed = True
            for p in self.batcher.drain(self.slot):
                p.deliver(not_served(self.model_id, ENDED))
            for r in self.routes + [self.shared]:
                for t in r.sessions.threads:
                    t.ids, t.conv = (list(t.conv.ids) if t.conv is not None else []), None
            self.cond.notify_all()


class EndpointServer:
    """The OpenAI-compatible endpoint of one TP leader (``dp_rank``: its port is ``endpoint.port + dp_rank``)."""

    def __init__(self, cfg: EndpointConfig, tokenizer=None, dp_rank: int = 0):
        cfg.validate()
        self.cfg, self.tokenizer, self.dp_rank = cfg, tokenizer, dp_rank
        if tokenizer is not None and build_chat_format(tokenizer).name != "chatml":
            raise EndpointError("the model's chat template is not ChatML, the one format the endpoint renders "
                                "requests in and reads tool calls from: serve a model with a ChatML template "
                                "(SmolLM2-Instruct, Qwen), or play this model with the agent loop (objective=agent)")
        self.api_key = cfg.api_key()
        self.port = cfg.port + dp_rank if cfg.port else 0
        if self.port > 65535:
            raise EndpointError(f"endpoint.port={cfg.port}: port + dp rank {dp_rank} exceeds 65535")
        self.url = ""
        self.token_bound = token_bound(tokenizer) if tokenizer is not None else None
        self._pools: tuple[concurrent.futures.ThreadPoolExecutor, ...] = ()  # (short requests, long ones)
        self._lock = threading.Lock()
        self._members: dict[str, Member] = {}  # model id -> the member served under it
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()  # token or id -> model id
        self._uv = self._thread = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "EndpointServer":
        try:
            import uvicorn

            from esopt_mp.endpoint.app import build_app
            from esopt_mp.endpoint.guard import Guard, GuardedServer, protocol
        except ImportError:
            raise EndpointError(_MISSING) from None
        files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if files != resource.RLIM_INFINITY and self.cfg.max_connections > files // 2:
            raise EndpointError(f"endpoint.max_connections={self.cfg.max_connections}: this process may open only "
                                f"{files} files (ulimit -n), which its connections share with the run's own; "
                                f"keep it at most {files // 2}, or raise the limit")
        host = self.cfg.host
        try:
            family = socket.getaddrinfo(host, self.port, type=socket.SOCK_STREAM)[0][0]
        except socket.gaierror as e:
            raise EndpointError(f"endpoint.host={host!r}: not an address this machine can bind ({e.strerror}); "
                                "e.g. 127.0.0.1, ::1 or 0.0.0.0") from None
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, self.port))
        except OSError as e:
            sock.close()
            what = "is in use" if e.errno in (errno.EADDRINUSE,) else f"cannot be bound ({e.strerror})"
            rank = f" (dp rank {self.dp_rank}: endpoint.port + {self.dp_rank})" if self.dp_rank else ""
            raise EndpointError(f"endpoint.port={self.cfg.port}: {host}:{self.port} {what}{rank}; "
                                "choose another port or 0 for a free one") from None
        sock.listen(128)
        port = sock.getsockname()[1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        guard = Guard(self.cfg.max_connections, self.cfg.request_timeout_s, self.url)
        config = uvicorn.Config(build_app(self), log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2, http=protocol(guard), backlog=128)
        self._uv = GuardedServer(config, guard)
        self._pools = (concurrent.futures.ThreadPoolExecutor(ENCODERS, thread_name_prefix=f"endpoint-{port}-encode"),
                       concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"endpoint-{port}-encode-long"))
        self._thread = threading.Thread(target=self._uv.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name=f"endpoint-{port}")
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uv.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise EndpointError(f"endpoint: the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        for m in list(self._members.values()):
            self._end(m)
        if self._uv is not None:
            self._uv.should_exit = True
            self._thread.join(10)
            self._uv = None
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)
        self._pools = ()

    def __enter__(self):
        return self.start() if self._uv is None else self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ members
    @contextlib.contextmanager
    def member(self, model_id: str, seeds: list[int], sampling: SamplingParams):
        """Serve ``model_id`` (episode k samples its first conversation with ``seeds[k]``) until the block ends."""
        with self.members([(model_id, seeds, -1)], sampling) as ms:
            yield ms[0]

    @contextlib.contextmanager
    def members(self, specs: list[tuple[str, list[int], int]], sampling: SamplingParams):
        """Serve every ``(model_id, seeds, slot)`` of ``specs`` at once until the block ends: one batcher, so that
        ``serve`` on any of them generates all their requests in one batch; ``slot``: the member's slot in the
        engine's members (es.member_batch), -1 for the engine's weights as they are (then the only member)."""
        if not self.url:
            raise RuntimeError("EndpointServer.member before start()")
        if len({model_id for model_id, _, _ in specs}) != len(specs):
            raise ValueError(f"members served at once need distinct model ids, got {[m for m, _, _ in specs]}")
        slots = [slot for _, _, slot in specs]
        if len(specs) != 1 and (min(slots) < 0 or len(set(slots)) != len(slots)):
            raise ValueError(f"several members served at once need distinct member slots (es.member_batch), got "
                             f"{slots}")
        cond = threading.Condition()
        batcher = Batcher(cond, self.cfg.batch_window_s, sum(len(s) for _, s, _ in specs))
        group, first = [], 0
        for model_id, seeds, slot in specs:
            group.append(Member(self, model_id, list(seeds), sampling, slot, first, (cond, batcher)))
            first += len(seeds)
        for m in group:
            m.group = group
        with self._lock:
            if self._members:
                raise RuntimeError(f"{[m.model_id for m in group]} opened while {list(self._members)} "
                                   f"{'is' if len(self._members) == 1 else 'are'} being served")
            for m in group:
                self._members[m.model_id] = m
                self._ended.pop(m.model_id, None)
        try:
            yield group
        finally:
            for m in group:
                self._end(m)

    def _end(self, m: Member) -> None:
        with self._lock:
            if self._members.get(m.model_id) is m:
                del self._members[m.model_id]
            for key in [m.model_id] + [r.token for r in m.routes]:
                self._ended[key] = m.model_id
            while len(self._ended) > 4096:
                self._ended.popitem(last=False)
        m._close()

    def resolve(self, token: str | None, model: str | None) -> tuple[Member, Route]:
        """The member and route a request reaches, or :class:`RequestError` (404 model_not_found)."""
        with self._lock:
            if token is not None:
                m, route = next(((m, r) for m in self._members.values() for r in m.routes if r.token == token),
                                (None, None))
                if route is None:
                    raise not_served(model or self._ended.get(token, "?"), ENDED if token in self._ended else
                                     "this route is not an episode of a member being served")
            elif len(self._members) > 1:  # the plain routes name their member
                m = self._members.get(model)
                if m is None:
                    raise not_served(model or "?", ENDED if model in self._ended else
                                     f"this endpoint serves {sorted(self._members)}: name one as the model")
                route = m.shared
            else:
                m = next(iter(self._members.values()), None)
                route = m.shared if m is not None else None
            if m is None:
                raise not_served(model or "?", ENDED if model in self._ended else "no member is being served")
            if model is not None and model != m.model_id:
                err = not_served(model, ENDED if model in self._ended else f"this endpoint serves {m.model_id!r}")
                if token is not None:  # an episode's request, refused: its record says so (it did reach us)
                    route.records.append({"model": model, "error": str(err), "seconds": 0.0})
                raise err
            return m, route

    def check_key(self, header: str | None) -> None:
        if not self.api_key:
            return
        scheme, _, got = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(got.strip().encode(), self.api_key.encode()):
            raise RequestError(401, "incorrect API key: send 'Authorization: Bearer <key>' with the endpoint's key",
                               code="invalid_api_key")

    async def chat(self, token: str | None, body: bytes, headers) -> tuple[int, object, bool]:
        """(status, body or SSE events, streamed) of one chat request (the app's handler calls this, once it has
        checked the key and read the body within ``endpoint.max_body_bytes``)."""
        req = parse_request(body)
        m, route = self.resolve(token, req["model"])
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def deliver(result):
            try:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))
            except RuntimeError:  # the server's loop is gone (closed): nobody waits for this reply
                pass

        pool = self._pools[len(body) > LONG_BYTES]  # long requests one at a time, never ahead of short ones
        await loop.run_in_executor(pool, m.submit, route, req, headers.get("x-session-id"), deliver)
        result = await fut
        if isinstance(result, RequestError):
            raise result
        if req.get("stream"):
            include = bool((req.get("stream_options") or {}).get("include_usage"))
            return 200, sse_chunks(m.model_id, result, include), True
        return 200, completion(m.model_id, result), False

    def models(self, token: str | None, headers, model: str | None = None) -> dict:
        """``GET .../models`` (the member being served, if any), or ``.../models/{model}``."""
        self.check_key(headers.get("authorization"))
        if model is not None:
            m, _ = self.resolve(token, model)
            return models_list([m.model_id])["data"][0]
        if token is None:
            with self._lock:
                return models_list(list(self._members))
        m, _ = self.resolve(token, None)
        return models_list([m.model_id])

