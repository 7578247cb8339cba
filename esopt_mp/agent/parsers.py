"""Tool-call parsers' former home: they live in :mod:`esopt_mp.chat.toolcalls`. Kept one release so that old
imports go on working, with a one-line notice."""
import warnings

from esopt_mp.chat.toolcalls import PARSERS, AnyParser, HermesJSONParser, QwenXMLParser, ToolCall, build_parser  # noqa: F401

warnings.warn("esopt_mp.agent.parsers is now esopt_mp.chat.toolcalls: import it from there (the old name goes in "
              "the next release)", DeprecationWarning, stacklevel=2)
