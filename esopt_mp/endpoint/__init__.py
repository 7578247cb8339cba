"""An OpenAI-compatible endpoint serving one ES member at a time, so an agent program plays it over HTTP."""
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
