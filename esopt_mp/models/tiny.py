"""Tiny Qwen3.5-architecture checkpoints built locally (nothing is downloaded).

The same code path as a real checkpoint: a ``Qwen3_5TextConfig`` with linear
(Gated DeltaNet) and full-attention layers, saved with ``save_pretrained`` as
safetensors and loaded back with ``from_pretrained``.
"""
from __future__ import annotations

import os

import torch


def tiny_qwen35_config(vocab_size: int = 512, hidden_size: int = 64, num_hidden_layers: int = 4,
                       intermediate_size: int = 128, **overrides):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=intermediate_size,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              tie_word_embeddings=False, max_position_embeddings=4096)
    kw.update(overrides)
    return Qwen3_5TextConfig(**kw)


def tiny_qwen3_config(vocab_size: int = 512, hidden_size: int = 64, num_hidden_layers: int = 2,
                      intermediate_size: int = 128, **overrides):
    from transformers import Qwen3Config

    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=intermediate_size,
              tie_word_embeddings=False, max_position_embeddings=4096)
    kw.update(overrides)
    return Qwen3Config(**kw)


def build_tiny_qwen35(path: str, seed: int = 0, arch: str = "qwen3_5", **config) -> str:
    """Write a randomly initialised tiny Qwen3.5 (or ``arch="qwen3"``) text model to ``path`` (idempotent)."""
    from transformers import AutoModelForCausalLM

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    builders = {"qwen3_5": tiny_qwen35_config, "qwen3": tiny_qwen3_config}
    if arch not in builders:
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {sorted(builders)}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(builders[arch](**config), dtype=torch.float32)
    tmp = f"{path}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        os.rename(tmp, path)
    except OSError:  # another rank got there first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


def build_tiny_agent_base(path: str, seed: int = 0, **config) -> str:
    """Tokenizer (local byte-level BPE, ChatML) plus a tiny Qwen3.5 sized to its vocabulary, in one directory."""
    from esopt_mp.models.tokenizer import build_tokenizer

    if os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return path
    tmp = f"{path}.tok{os.getpid()}"
    tok = build_tokenizer(tmp)
    build_tiny_qwen35(path, seed=seed, vocab_size=len(tok), **config)
    tok.save_pretrained(path)
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return path
