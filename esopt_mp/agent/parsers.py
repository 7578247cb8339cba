"""Tool-call parsers: they live in :mod:`esopt_mp.chat.toolcalls`."""
from esopt_mp.chat.toolcalls import PARSERS, AnyParser, HermesJSONParser, QwenXMLParser, ToolCall, build_parser  # noqa: F401
