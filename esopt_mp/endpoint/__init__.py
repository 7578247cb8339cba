"""An OpenAI-compatible endpoint serving ES members (one at a time, or a batch of low-rank members at once), so an
agent program plays them over HTTP."""
from esopt_mp.lazy import lazy_exports

_EXPORTS = {
    "EndpointConfig": "config",
    "EndpointError": "config",
    "EndpointServer": "server",
    "parse_reply": "render",
    "system_with_tools": "render",
    "tools_block": "render",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
