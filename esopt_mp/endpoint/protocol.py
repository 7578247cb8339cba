"""The OpenAI chat-completions wire format: request validation, responses, SSE chunks and error bodies.

Only what decides the member's text is read from a request: ``messages``, ``tools``, ``tool_choice`` ("none":
no tool calls are read from the reply), ``max_tokens`` / ``max_completion_tokens`` (a cap below the run's), and
``stream`` / ``stream_options``. Sampling settings (``temperature``, ``top_p``, ``seed``, ``stop``, penalties...)
are ignored: the member is sampled with the run's settings, the policy ES trains.
"""
from __future__ import annotations

import json
import time
import uuid

ROLES = ("system", "developer", "user", "assistant", "tool")
ENDED = "the member's evaluation ended"


class RequestError(ValueError):
    """A request the endpoint refuses: HTTP ``status``, an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def not_served(model: str, why: str) -> RequestError:
    return RequestError(404, f"model {model!r} is not being served ({why})", "model", "model_not_found")


def too_large(cap: int) -> RequestError:
    return RequestError(413, f"the request body is over {cap} bytes (endpoint.max_body_bytes)",
                        code="request_too_large")


def _bad(param: str, message: str) -> RequestError:
    return RequestError(400, f"{param}: {message}", param)


def _content(c, param: str) -> None:
    if c is None or isinstance(c, str):
        return
    if not isinstance(c, list):
        raise _bad(param, "must be a string or a list of text parts")
    for k, part in enumerate(c):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _bad(f"{param}[{k}]", "only text parts are served ({'type': 'text', 'text': ...})")


def _tool_calls(calls, param: str) -> None:
    if not isinstance(calls, list):
        raise _bad(param, "must be a list")
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{param}[{k}]", "must be {'type': 'function', 'function': {'name': ..., 'arguments': ...}}")


def parse_request(raw: bytes) -> dict:
    """The validated request (a JSON object), or :class:`RequestError` (400, naming the parameter)."""
    try:
        req = json.loads(raw)
    except ValueError as e:
        raise RequestError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:  # nesting deeper than the parser's stack: no chat request is
        raise RequestError(400, "the body is not valid JSON here: nested too deeply") from None
    if not isinstance(req, dict):
        raise RequestError(400, "the body must be a JSON object")
    if not isinstance(req.get("model"), str) or not req["model"]:
        raise _bad("model", "required: the served member's id (GET /v1/models)")
    msgs = req.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "required: a non-empty list of messages")
    for k, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"messages[{k}].role", f"must be one of {', '.join(ROLES)}")
        _content(m.get("content"), f"messages[{k}].content")
        if m.get("tool_calls") is not None:
            _tool_calls(m["tool_calls"], f"messages[{k}].tool_calls")
    tools = req.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", "must be a list")
        for k, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise _bad(f"tools[{k}]", "must be {'type': 'function', 'function': {'name': ..., ...}}")
    if req.get("n") is not None and (isinstance(req["n"], bool) or req["n"] != 1):
        raise _bad("n", f"only n=1 is served (one reply per request), got {req['n']!r}")
    for p in ("max_tokens", "max_completion_tokens"):
        v = req.get(p)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise _bad(p, f"must be an integer >= 1, got {v!r}")
    if not isinstance(req.get("stream", False), (bool, type(None))):
        raise _bad("stream", "must be true or false")
    opts = req.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("stream_options", "must be an object")
    return req


def request_cap(req: dict) -> int | None:
    caps = [v for v in (req.get("max_tokens"), req.get("max_completion_tokens")) if v is not None]
    return min(caps) if caps else None


def usage(turn) -> dict:
    return {"prompt_tokens": turn.prompt_tokens, "completion_tokens": turn.completion_tokens,
            "total_tokens": turn.prompt_tokens + turn.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": turn.cached_tokens}}


def reply_message(turn) -> dict:
    msg = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        msg["tool_calls"] = turn.tool_calls
    return msg


def completion(model: str, turn) -> dict:
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": reply_message(turn), "logprobs": None,
                                         "finish_reason": turn.finish_reason}], "usage": usage(turn)}


def sse_chunks(model: str, turn, include_usage: bool) -> list[str]:
    """The whole reply as SSE events: role, content, tool calls, finish, (usage), ``[DONE]``."""
    base = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model}
    if include_usage:
        base["usage"] = None

    def chunk(delta: dict, finish=None) -> dict:
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    events = [chunk({"role": "assistant", "content": ""})]
    if turn.content:
        events.append(chunk({"content": turn.content}))
    if turn.tool_calls:
        events.append(chunk({"tool_calls": [{"index": k, **c} for k, c in enumerate(turn.tool_calls)]}))
    events.append(chunk({}, turn.finish_reason))
    if include_usage:
        events.append({**base, "choices": [], "usage": usage(turn)})
    return [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]


def models_list(model_ids: list[str]) -> dict:
    return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "esopt_mp"}
                                       for m in model_ids]}
