"""Agentic policy-gradient baselines (GRPO, PPO) on the same agent loop, environments and metrics as ES.

They exist to compare against: the same episodes (``agent.loop.run_episodes``),
the same launcher (``algo=grpo|ppo``), curves that overlay with ES runs, and
the memory a gradient trainer needs (profiled by ``tools/memprof.py``).
"""
from esopt_mp.baselines.algos import GRPO, PPO
from esopt_mp.baselines.batch import TokenBatch, build_token_batch, synthetic_token_batch
from esopt_mp.baselines.optimizer import PolicyOptimizer

BASELINES = {"grpo": GRPO, "ppo": PPO}


def build_baseline(name: str, model, cfg, dims) -> PolicyOptimizer:
    """The ``name`` optimizer ("grpo" | "ppo") for ``model``, configured by ``cfg`` (an AlgoConfig)."""
    if name not in BASELINES:
        raise ValueError(f"algo: unknown baseline {name!r}; known: {', '.join(sorted(BASELINES))}")
    return BASELINES[name](model, cfg, dims)


__all__ = ["BASELINES", "GRPO", "PPO", "PolicyOptimizer", "TokenBatch", "build_baseline", "build_token_batch",
           "synthetic_token_batch"]
