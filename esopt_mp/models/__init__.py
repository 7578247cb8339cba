"""Model loading onto the tp mesh, canonical (checkpoint) names, shard maps, export, tiny local checkpoints.

The names below load on first use (PEP 562), so importing ``esopt_mp.models.config`` loads no torch.
"""
from esopt_mp.lazy import lazy_exports

_EXPORTS = {
    "export_hf": "export", "build_shards": "loading", "full_state_dict": "loading", "load_model": "loading",
    "resolve_model_dir": "paths", "CheckpointNames": "names", "checkpoint_keys": "names", "checkpoint_names": "names",
    "build_tiny_qwen35": "tiny", "tiny_qwen3_config": "tiny", "tiny_qwen35_config": "tiny", "QWEN35": "presets",
    "build_meta_model": "presets", "qwen35_config": "presets",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
