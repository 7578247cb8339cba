"""Model loading onto the tp mesh, canonical (checkpoint) names, shard maps, export, tiny local checkpoints.

The names below load on first use (PEP 562), so importing ``esopt_mp.models.config`` loads no torch.
"""
import importlib

_EXPORTS = {
    "export_hf": "export", "build_shards": "loading", "full_state_dict": "loading", "load_model": "loading",
    "resolve_model_dir": "paths", "CheckpointNames": "names", "checkpoint_keys": "names", "checkpoint_names": "names",
    "build_tiny_qwen35": "tiny", "tiny_qwen3_config": "tiny", "tiny_qwen35_config": "tiny", "QWEN35": "presets",
    "build_meta_model": "presets", "qwen35_config": "presets",
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
