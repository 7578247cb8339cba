"""A chat request's prompt text, rendered as the in-process agent loop renders it, and a reply parsed back.

The loop's ChatML (:mod:`esopt_mp.chat.format`) extended with Qwen3's chat-template tools block (appended to the
first system message, or a system message put first) and assistant history messages' ``tool_calls`` (content,
then one ``<tool_call>`` block per call). An environment of the in-process loop that puts
:func:`system_with_tools`' text in its system prompt sees, token for token, what the endpoint's client sees.
"""
from __future__ import annotations

import json

from esopt_mp.chat.format import clean_text, delta_text, opening_text
from esopt_mp.chat.toolcalls import blocks, build_parser

TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
              "<args-json-object>}\n</tool_call>")


def text_of(content) -> str:
    """A message's text: a string, None (''), or a list of text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content)


def tools_block(tools: list[dict]) -> str:
    """Qwen3's tools block: one JSON line per tool (as its template's ``tojson`` writes it)."""
    return TOOLS_HEAD + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_TAIL


def system_with_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """``messages`` with :func:`tools_block` appended to the first system message (or a system message put first);
    unchanged without tools."""
    out = [dict(m) for m in messages]
    if not tools:
        return out
    block = tools_block(tools)
    if out and out[0].get("role") in ("system", "developer"):
        out[0]["content"] = f"{text_of(out[0].get('content'))}\n\n{block}"
        return out
    return [{"role": "system", "content": block}] + out


def call_text(call: dict) -> str:
    """One tool call of an assistant history message as Qwen3's template writes it."""
    fn = call.get("function") or call
    args = fn.get("arguments")
    args = args if isinstance(args, str) else json.dumps(args if args is not None else {}, ensure_ascii=False)
    return f'<tool_call>\n{{"name": "{fn.get("name", "")}", "arguments": {args}}}\n</tool_call>'


def chat_message(m: dict) -> dict:
    """A request message as :func:`esopt_mp.chat.format.render_message` takes it (role, text content)."""
    role = "system" if m["role"] == "developer" else m["role"]
    content = text_of(m.get("content"))
    if role == "assistant" and m.get("tool_calls"):
        content += "".join(("\n" if k or content else "") + call_text(c) for k, c in enumerate(m["tool_calls"]))
    return {"role": role, "content": content}


def prompt_text(messages: list[dict], tools: list[dict] | None) -> str:
    """A new conversation's whole prompt: every message, then the generation prompt."""
    return clean_text(opening_text([chat_message(m) for m in system_with_tools(messages, tools)]))


def continuation_text(ended_with_im_end: bool, new_messages: list[dict]) -> str:
    """What a continuing conversation appends after the member's own reply (the loop's delta)."""
    return clean_text(delta_text(ended_with_im_end, [chat_message(m) for m in new_messages]))


def parse_reply(text: str, parser: str = "hermes", tools: list[dict] | None = None, finish: str = "eos",
                id_prefix: str = "call_") -> tuple[str | None, list[dict], str]:
    """(content, tool_calls, finish_reason) of a reply's text, as the OpenAI API returns them.

    Tool calls are read only when the request offered ``tools``; each well-formed ``<tool_call>`` block becomes a
    call and leaves the content, a malformed one stays in the content as text. ``finish``: the engine's (eos, stop,
    length)."""
    calls, spans = [], []
    if tools:
        p = build_parser(parser)
        for span, block in blocks(text):
            found = p.parse(block)
            if found and all(c.error is None for c in found):
                spans.append(span)
                calls += [{"id": f"{id_prefix}{len(calls) + k}", "type": "function",
                           "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                          for k, c in enumerate(found)]
    if not calls:
        return text, [], "length" if finish == "length" else "stop"
    rest, last = [], 0
    for a, b in spans:
        rest.append(text[last:a])
        last = b
    rest.append(text[last:])
    return "".join(rest).strip() or None, calls, "tool_calls"
