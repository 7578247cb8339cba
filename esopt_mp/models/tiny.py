"""Tiny Qwen3.5-architecture checkpoints built locally (nothing is downloaded).

The same code path as a real checkpoint: a ``Qwen3_5TextConfig`` with linear
(Gated DeltaNet) and full-attention layers, saved with ``save_pretrained`` as
safetensors and loaded back with ``from_pretrained``. Every builder has a
``tie_word_embeddings`` switch (off by default; Qwen3.5-4B is tied), and
:func:`build_tiny_qwen35_vlm` writes the multimodal layout real Qwen3.5
checkpoints have (text weights under ``model.language_model.*``).
"""
from __future__ import annotations

import os

import torch

from esopt_mp.runfiles import fresh_dir


def tiny_qwen35_config(vocab_size: int = 512, hidden_size: int = 64, num_hidden_layers: int = 4,
                       intermediate_size: int = 128, tie_word_embeddings: bool = False, **overrides):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=intermediate_size,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              tie_word_embeddings=tie_word_embeddings, max_position_embeddings=4096)
    kw.update(overrides)
    return Qwen3_5TextConfig(**kw)


def tiny_qwen3_config(vocab_size: int = 512, hidden_size: int = 64, num_hidden_layers: int = 2,
                      intermediate_size: int = 128, tie_word_embeddings: bool = False, **overrides):
    from transformers import Qwen3Config

    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=intermediate_size,
              tie_word_embeddings=tie_word_embeddings, max_position_embeddings=4096)
    kw.update(overrides)
    return Qwen3Config(**kw)


def tiny_qwen35_vlm_config(tie_word_embeddings: bool = False, **text):
    """A ``Qwen3_5Config`` (text + a one-block vision tower), the layout of the released Qwen3.5 checkpoints."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5VisionConfig

    tc = tiny_qwen35_config(tie_word_embeddings=tie_word_embeddings, **text)
    vc = Qwen3_5VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                             out_hidden_size=tc.hidden_size, num_position_embeddings=16)
    v = tc.vocab_size
    return Qwen3_5Config(text_config=tc.to_dict(), vision_config=vc.to_dict(), tie_word_embeddings=tie_word_embeddings,
                         image_token_id=v - 4, video_token_id=v - 3, vision_start_token_id=v - 2,
                         vision_end_token_id=v - 1)


def tiny_config(arch: str = "qwen3_5", **config):
    """The transformers config of a tiny model of ``arch`` (what :func:`build_tiny_qwen35` writes)."""
    builders = {"qwen3_5": tiny_qwen35_config, "qwen3": tiny_qwen3_config, "qwen3_5_vlm": tiny_qwen35_vlm_config}
    if arch not in builders:
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {sorted(builders)}")
    return builders[arch](**config)


def build_tiny_qwen35(path: str, seed: int = 0, arch: str = "qwen3_5", **config) -> str:
    """Write a randomly initialised tiny model to ``path`` (idempotent).

    ``arch``: ``"qwen3_5"`` (text), ``"qwen3"``, or ``"qwen3_5_vlm"`` (a
    ``Qwen3_5ForConditionalGeneration`` whose text weights sit under
    ``model.language_model.*``; ``AutoModelForCausalLM`` loads it as text-only).
    """
    from transformers import AutoModelForCausalLM

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    cfg = tiny_config(arch, **config)
    torch.manual_seed(seed)
    if arch == "qwen3_5_vlm":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

        model = Qwen3_5ForConditionalGeneration(cfg).float()
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tmp = f"{path}.tmp{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    model.save_pretrained(fresh_dir(tmp))  # a folder of this call's own, whatever was at its name
    try:
        os.rename(tmp, path)
    except OSError:  # another rank got there first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


TINY_AGENT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tiny_agent")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_agent_base(path: str, seed: int = 0, tokenizer_dir: str = TINY_AGENT, **config) -> str:
    """A chat tokenizer plus a randomly initialised tiny Qwen3.5 sized to its vocabulary, in one directory.

    The tokenizer's files are copied from ``tokenizer_dir``: by default the shipped tiny agent's (a local
    byte-level BPE with the ChatML template, trained on environment text by ``tools/build_tiny_agent.py``).
    """
    import shutil

    from transformers import AutoTokenizer

    if os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return path
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    build_tiny_qwen35(path, seed=seed, vocab_size=len(tok), **config)
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(path, name))
    return path
