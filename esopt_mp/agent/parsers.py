"""Tool-call parsers: they live in :mod:`esopt_mp.envs.toolcalls` (envs parse tool calls and never import agent/)."""
from esopt_mp.envs.toolcalls import PARSERS, AnyParser, HermesJSONParser, QwenXMLParser, ToolCall, build_parser

__all__ = ["PARSERS", "AnyParser", "HermesJSONParser", "QwenXMLParser", "ToolCall", "build_parser"]
