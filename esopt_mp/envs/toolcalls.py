"""Tool-call parsing for environments: it lives in :mod:`esopt_mp.chat.toolcalls` (one parser for the environments,
the agent loop and the endpoint). These names stay here for environment plugins."""
from esopt_mp.chat.toolcalls import (  # noqa: F401
    MAX_CALLS, MAX_DEPTH, PARSERS, AnyParser, HermesJSONParser, QwenXMLParser, ToolCall, build_parser, clean_text,
    clean_value,
)
