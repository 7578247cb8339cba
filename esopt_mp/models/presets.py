"""Shapes of the Qwen3.5 text models (their released configs), buildable on the meta device in < 2 s.

Real-size accounting (parameter bytes, communication, memory plans) needs no weights.
"""
from __future__ import annotations

import torch

_COMMON = dict(vocab_size=248320, head_dim=256, num_key_value_heads=4, linear_num_key_heads=16,
               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
QWEN35 = {
    "4b": dict(hidden_size=2560, num_hidden_layers=32, num_attention_heads=16, intermediate_size=9216,
               linear_num_value_heads=32, tie_word_embeddings=True),
    "9b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=16, intermediate_size=12288,
               linear_num_value_heads=32, tie_word_embeddings=False),
    "27b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, intermediate_size=17408,
                linear_num_value_heads=48, tie_word_embeddings=False),
}


def qwen35_config(size: str):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    if size not in QWEN35:
        raise ValueError(f"unknown Qwen3.5 size {size!r}; known: {sorted(QWEN35)}")
    return Qwen3_5TextConfig(**_COMMON, **QWEN35[size])


def build_meta_model(size: str):
    """The full-size model with every parameter on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(qwen35_config(size))
