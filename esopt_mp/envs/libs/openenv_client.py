"""Talking to an OpenEnv server (:mod:`esopt_mp.envs.libs.openenv`): OpenEnv's WebSocket client with the server's
error replies kept as coded errors, its HTTP ``/health`` and ``/schema`` routes, and the JSON object of a reply.

OpenEnv itself is imported only when the first client is made (an episode's reset).
"""
from __future__ import annotations

import json
import threading
import urllib.parse
import urllib.request

_MAX_STARTS = 256  # '{' positions that start no JSON object tried at most (stray braces: that many parses)
_SCHEMAS: dict[str, str] = {}
_SCHEMA_LOCK = threading.Lock()


class ServerError(Exception):
    """The server answered a message with an error (``{"type": "error", "data": {"code", "message", ...}}``)."""

    def __init__(self, data: dict):
        self.data = data if isinstance(data, dict) else {"message": str(data)}
        self.code = str(self.data.get("code", "UNKNOWN"))
        super().__init__(f"{self.code}: {str(self.data.get('message', ''))[:300]}")


_CLIENT: list = []


def client_class():
    """OpenEnv's generic (dict) WebSocket client, its error replies raised as :class:`ServerError` with their
    code (the library's own raise folds the code into a message string)."""
    if not _CLIENT:
        from openenv.core import GenericEnvClient

        class Client(GenericEnvClient):
            async def _send_and_receive(self, message):
                try:
                    await self._send(message)
                except Exception:  # a server refusing the session (at capacity) says why, then closes: read it
                    try:
                        response = await self._receive()
                    except Exception:  # noqa: BLE001 - nothing was said: the send's own error stands
                        response = None
                    if isinstance(response, dict) and response.get("type") == "error":
                        raise ServerError(response.get("data") or {}) from None
                    raise
                response = await self._receive()
                if not isinstance(response, dict):
                    raise TypeError(f"the server sent {type(response).__name__}, not a message object")
                if response.get("type") == "error":
                    raise ServerError(response.get("data") or {})
                return response

        _CLIENT.append(Client)
    return _CLIENT[0]


def http_base(url: str) -> str:
    """The server's http(s) base address (``ws://h:p/ws`` -> ``http://h:p``)."""
    base = url.rstrip("/")
    base = base[:-3] if base.endswith("/ws") else base
    if base.startswith("ws://"):
        return "http://" + base[5:]
    if base.startswith("wss://"):
        return "https://" + base[6:]
    return base


def _get(url: str, route: str, timeout_s: float):
    """``GET`` a route of the server, past any proxy for a loopback address (as OpenEnv's client connects)."""
    base = http_base(url)
    host = urllib.parse.urlsplit(base).hostname or ""
    handlers = [urllib.request.ProxyHandler({})] if host in ("localhost", "127.0.0.1", "::1") else []
    return urllib.request.build_opener(*handlers).open(base + route, timeout=timeout_s)


def healthy(url: str, timeout_s: float) -> bool:
    """Whether the server answers ``GET /health``."""
    try:
        with _get(url, "/health", timeout_s) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


def action_schema(url: str, timeout_s: float) -> str:
    """The Action's fields as the server's ``/schema`` describes them (JSON), fetched once per address."""
    with _SCHEMA_LOCK:
        if url not in _SCHEMAS:
            with _get(url, "/schema", timeout_s) as r:
                schema = json.loads(r.read().decode("utf-8", "replace")).get("action") or {}
            props = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
            _SCHEMAS[url] = json.dumps({"properties": props, "required": schema.get("required", [])})
        return _SCHEMAS[url]


def find_json_object(text: str) -> dict | None:
    """The last top-level JSON object written in ``text`` (None if there is none)."""
    decoder, found, i, misses = json.JSONDecoder(), None, text.find("{"), 0
    while i >= 0 and misses < _MAX_STARTS:  # a parsed object is skipped whole: only the misses can add up
        try:
            value, end = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            misses += 1
            i = text.find("{", i + 1)
            continue
        if isinstance(value, dict):
            found = value
        i = text.find("{", end)
    return found


def refusal(data: dict) -> str:
    """The reasons of a server's validation error, one per refused field."""
    errors = data.get("errors")
    if not isinstance(errors, list) or not errors:
        return str(data.get("message") or "the action was refused")[:500]
    lines = []
    for e in errors[:8]:
        if isinstance(e, dict):
            loc = ".".join(str(p) for p in e.get("loc") or ()) or "action"
            lines.append(f"{loc}: {str(e.get('msg', e.get('type', 'invalid')))[:200]}")
    return "; ".join(lines) or "the action was refused"
