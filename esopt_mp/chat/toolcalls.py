"""Tool-call parsers, pluggable: Qwen3.5's XML format and Hermes-style JSON. The one reader of tool calls: the
environments and the agent loop parse a whole reply, the endpoint block by block (:func:`blocks`).

Qwen3.5 (XML)::

    <tool_call>
    <function=python>
    <parameter=code>
    print(1 + 1)
    </parameter>
    </function>
    </tool_call>

Hermes (JSON)::

    <tool_call>{"name": "python", "arguments": {"code": "print(1 + 1)"}}</tool_call>
"""
from __future__ import annotations

import dataclasses
import json
import re

from esopt_mp.chat.format import clean_text


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict
    error: str | None = None  # set when the call was recognised but malformed


_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_FUNC = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


MAX_CALLS = 4  # tool calls run per reply (the rest are answered "not run"): a turn's time stays bounded
MAX_DEPTH = 16  # nesting an argument may have: deeper JSON is refused (copying or logging it would recurse)


def clean_value(v):
    """``v`` with every string in it (lists and objects included) made valid text; for values of bounded depth."""
    if isinstance(v, str):
        return clean_text(v)
    if isinstance(v, list):
        return [clean_value(x) for x in v]
    if isinstance(v, dict):
        return {clean_text(str(k)): clean_value(x) for k, x in v.items()}
    return v


def depth(v) -> int:
    """How deeply ``v`` nests lists and objects (iterative: a deep value must not recurse here either)."""
    deepest, todo = 0, [(v, 0)]
    while todo:
        x, d = todo.pop()
        deepest = max(deepest, d)
        if d <= MAX_DEPTH and isinstance(x, (list, dict)):
            todo += [(y, d + 1) for y in (x.values() if isinstance(x, dict) else x)]
    return deepest


class QwenXMLParser:
    name = "qwen_xml"

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for block in _BLOCK.findall(text):
            for fname, body in _FUNC.findall(block):
                args = {clean_text(k): clean_text(v) for k, v in _PARAM.findall(body)}
                calls.append(ToolCall(clean_text(fname), args))
        return calls


class HermesJSONParser:
    name = "hermes"

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for block in _BLOCK.findall(text):
            block = block.strip()
            if not block.startswith("{"):
                continue
            try:
                obj = json.loads(block)
                args = obj.get("arguments", {})
                if isinstance(args, str):
                    args = json.loads(args)
                if not isinstance(obj["name"], str) or not isinstance(args, dict):
                    raise TypeError("'name' must be a string and 'arguments' an object")
                if depth(args) > MAX_DEPTH:
                    raise RecursionError
                calls.append(ToolCall(clean_text(obj["name"]), clean_value(args)))
            except (KeyError, TypeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
                reason = "nested too deeply" if isinstance(e, RecursionError) else clean_text(str(e))[:200]
                calls.append(ToolCall("", {}, error=f"malformed JSON tool call: {reason}"))
        return calls


class AnyParser:
    """Tries each parser in turn; the first that finds calls wins."""

    name = "any"

    def __init__(self, parsers=None):
        self.parsers = parsers or [QwenXMLParser(), HermesJSONParser()]

    def parse(self, text: str) -> list[ToolCall]:
        for p in self.parsers:
            calls = p.parse(text)
            if calls:
                return calls
        return []


def blocks(text: str):
    """Each ``<tool_call>`` block of ``text`` (an unclosed last one runs to the end), as ``(span, block_text)``: the
    endpoint parses block by block, so a malformed block stays in the reply's content as text."""
    for m in _BLOCK.finditer(text):
        yield m.span(), m.group(0)


PARSERS = {"qwen_xml": QwenXMLParser, "hermes": HermesJSONParser, "any": AnyParser}


def build_parser(name: str = "any"):
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(PARSERS)}")
    return PARSERS[name]()
