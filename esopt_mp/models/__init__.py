"""Model loading onto the tp mesh, shard maps, tiny local checkpoints."""
from esopt_mp.models.loading import build_shards, full_state_dict, load_model
from esopt_mp.models.tiny import build_tiny_qwen35, tiny_qwen35_config

__all__ = ["build_shards", "build_tiny_qwen35", "full_state_dict", "load_model", "tiny_qwen35_config"]
from esopt_mp.models.presets import QWEN35, build_meta_model, qwen35_config  # noqa: E402

__all__ += ["QWEN35", "build_meta_model", "qwen35_config"]
