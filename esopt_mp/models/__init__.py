"""Model loading onto the tp mesh, canonical (checkpoint) names, shard maps, export, tiny local checkpoints."""
from esopt_mp.models.export import export_hf
from esopt_mp.models.loading import build_shards, full_state_dict, load_model
from esopt_mp.models.paths import resolve_model_dir
from esopt_mp.models.names import CheckpointNames, checkpoint_keys, checkpoint_names
from esopt_mp.models.tiny import build_tiny_qwen35, tiny_qwen3_config, tiny_qwen35_config

__all__ = ["CheckpointNames", "build_shards", "build_tiny_qwen35", "checkpoint_keys", "checkpoint_names", "export_hf",
           "full_state_dict", "load_model", "resolve_model_dir", "tiny_qwen3_config", "tiny_qwen35_config"]
from esopt_mp.models.presets import QWEN35, build_meta_model, qwen35_config  # noqa: E402

__all__ += ["QWEN35", "build_meta_model", "qwen35_config"]
