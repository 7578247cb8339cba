"""Agentic policy-gradient baselines (GRPO, PPO) on the same agent loop, environments and metrics as ES.

They exist to compare against: the same episodes (``agent.loop.run_episodes``),
the same launcher (``algo=grpo|ppo``), curves that overlay with ES runs, and
the memory a gradient trainer needs (profiled by ``tools/memprof.py``).
The names below load on first use (PEP 562), so importing ``esopt_mp.baselines.config`` loads no torch.
"""
from esopt_mp.lazy import lazy_exports

_EXPORTS = {
    "GRPO": "algos", "PPO": "algos", "TokenBatch": "batch", "build_token_batch": "batch",
    "synthetic_token_batch": "batch", "PolicyOptimizer": "optimizer",
}


def build_baseline(name: str, model, cfg, dims):
    """The ``name`` optimizer ("grpo" | "ppo") for ``model``, configured by ``cfg`` (an AlgoConfig)."""
    from esopt_mp.baselines.algos import GRPO, PPO

    baselines = {"grpo": GRPO, "ppo": PPO}
    if name not in baselines:
        raise ValueError(f"algo: unknown baseline {name!r}; known: {', '.join(sorted(baselines))}")
    return baselines[name](model, cfg, dims)


__all__ = sorted([*_EXPORTS, "build_baseline"])

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
