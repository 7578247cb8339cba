"""The ``algo`` section: which trainer runs (ES or a policy-gradient baseline) and the baselines' settings.

Plain Python (no torch): the run config and the launcher's ``algo=`` check import it.
"""
from __future__ import annotations

import dataclasses
import math

from esopt_mp.typed import check


ALGOS = ("es", "grpo", "ppo")


@dataclasses.dataclass
class AlgoConfig:
    """Which trainer runs (``es``, or a policy-gradient baseline) and the baselines' settings.

    Defaults: the paper's GRPO reference for Sudoku (lr 1e-6, KL beta
    1e-3, clip 0.2, 8 generations, batch 32 = 4 tasks x 8). ``es`` ignores the rest.
    """
    name: str = "es"
    lr: float = 1e-6
    beta: float = 1e-3  # KL(pi || ref) weight, k3 estimator; 0: no reference model is kept
    clip: float = 0.2
    generations: int = 8  # rollouts per task (GRPO's group size)
    tasks_per_step: int = 4
    steps: int | None = None  # None: es.steps, so the same override sets both
    epochs: int = 1
    minibatch: int = 0  # episodes per optimizer step (0: the whole batch, one step per epoch)
    micro_batch: int = 0  # episodes per forward/backward (gradient accumulation; 0: = minibatch)
    max_grad_norm: float = 1.0  # 0: no clipping
    weight_decay: float = 0.0
    temperature: float = 1.0  # training rollouts' sampling temperature (greedy groups have no variance)
    grad_checkpointing: bool = False
    zero_stage: int = 0  # > 0: DeepSpeed ZeRO stage 1-3 (launch under deepspeed, tp = 1)
    adv_eps: float = 1e-4
    gamma: float = 1.0  # PPO: discount per turn
    lam: float = 0.95  # PPO: GAE lambda per turn
    vf_coef: float = 0.1
    value_clip: float = 0.2
    value_lr: float | None = None  # PPO value head's lr (None: lr)

    def validate(self, key: str = "algo") -> None:
        check(self.name in ALGOS, f"{key}", f"unknown algorithm {self.name!r}; known: {', '.join(ALGOS)}")
        for k in ("lr", "value_clip"):
            v = getattr(self, k)
            check(math.isfinite(v) and v > 0, f"{key}.{k}", f"must be finite and > 0, got {v}")
        check(0 < self.clip < 1, f"{key}.clip",
              f"must be in (0, 1) (the ratio's range is [1-clip, 1+clip]), got {self.clip}")
        for k in ("beta", "max_grad_norm", "weight_decay", "temperature", "adv_eps", "vf_coef"):
            v = getattr(self, k)
            check(math.isfinite(v) and v >= 0, f"{key}.{k}", f"must be finite and >= 0, got {v}")
        for k in ("gamma", "lam"):
            v = getattr(self, k)
            check(0 <= v <= 1, f"{key}.{k}", f"must be in [0, 1], got {v}")
        for k in ("generations", "tasks_per_step", "epochs"):
            check(getattr(self, k) >= 1, f"{key}.{k}", f"must be >= 1, got {getattr(self, k)}")
        for k in ("minibatch", "micro_batch"):
            check(getattr(self, k) >= 0, f"{key}.{k}", f"must be >= 0 (0: whole batch), got {getattr(self, k)}")
        check(self.steps is None or self.steps >= 1, f"{key}.steps", f"must be >= 1, got {self.steps}")
        check(self.zero_stage in (0, 1, 2, 3), f"{key}.zero_stage", f"must be 0, 1, 2 or 3, got {self.zero_stage}")
        check(self.value_lr is None or (math.isfinite(self.value_lr) and self.value_lr > 0), f"{key}.value_lr",
              f"must be finite and > 0, got {self.value_lr}")
        check(self.name != "grpo" or self.generations >= 2, f"{key}.generations",
              f"GRPO needs at least 2 rollouts per task for a group advantage, got {self.generations}")
        check(self.name == "es" or self.temperature > 0, f"{key}.temperature",
              "policy-gradient rollouts must sample (temperature > 0)")
