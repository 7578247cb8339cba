"""ES numerics: layout-invariant noise, seeds, shaping, schedules and the Perturber.

The names below load on first use (PEP 562), so importing a light submodule (``esopt_mp.es.config``) loads no torch.
"""
import importlib

_EXPORTS = {
    "fill_": "noise", "gaussian": "noise", "local_noise": "noise", "stream": "noise",
    "Perturber": "perturber", "build_local_shards": "perturber",
    "Schedule": "schedules", "member_seed": "seeds", "population": "seeds", "splitmix64": "seeds",
    "shape_returns": "shaping",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
