"""The ``es`` section: population, schedules, shaping, precision modes and which tensors are perturbed.

Plain Python (no torch): the run config imports it to validate before any model exists. The choices below are the
ones the components accept; they check their arguments with the same functions, so both paths say the same line.
"""
from __future__ import annotations

import dataclasses
import math

from esopt_mp.es.seeds import KINDS as SCHEDULE_KINDS, check_schedule
from esopt_mp.typed import check, check_choice

RESTORE_MODES = ("subtract", "snapshot")  # subtract: theta - sigma*eps (no copy); snapshot: exact copy back
MASTER_MODES = ("none", "fp32_host")  # fp32_host: an fp32 master copy of low-precision weights on the host
NOISE_BACKENDS = ("auto", "eager", "compile", "triton")  # esopt_mp/es/backend.py
SHAPINGS = ("zscore", "centered_rank", "raw")  # esopt_mp/es/shaping.py
NOISE_MODES = ("full", "lowrank")  # full: every element its own eps; lowrank: A B^T / sqrt(r) per 2-D tensor
MAX_RANK = 64  # es.rank: far above what batching members pays for; bounds the factors ((m + n) r per member)
DECAY_TARGETS = ("zero", "start")  # what es.weight_decay pulls the weights toward: 0, or the run's starting weights
MIN_CHUNK_ELEMS = 1024

__all__ = ["DECAY_TARGETS", "ESConfig", "MASTER_MODES", "MAX_RANK", "NOISE_BACKENDS", "NOISE_MODES", "RESTORE_MODES",
           "SCHEDULE_KINDS", "SHAPINGS", "ScheduleConfig"]


@dataclasses.dataclass
class ScheduleConfig:
    kind: str = "cosine"
    start: float = 1e-3
    end: float = 2.5e-4
    steps: int | None = None  # None: follow the run, end at its last step (es.steps - 1)

    def validate(self, key: str) -> None:
        check_schedule(self.kind, self.start, self.end, self.steps, key)


@dataclasses.dataclass
class ESConfig:
    population: int = 8
    steps: int = 20
    mirrored: bool = True
    sigma: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    alpha: ScheduleConfig = dataclasses.field(default_factory=lambda: ScheduleConfig("constant", 5e-4, 5e-4))
    shaping: str = "zscore"
    restore: str = "snapshot"
    master: str = "none"
    chunk_elems: int = 1 << 24
    noise_backend: str = "auto"  # esopt_mp/es/backend.py: triton on CUDA, compile for large CPU shards
    noise: str = "full"  # lowrank: each 2-D tensor perturbed by a rank-`rank` product, others not (es/lowrank.py)
    rank: int = 1
    member_batch: bool = False  # lowrank: a dp group's members in one batched generation (engine/members.py)
    weight_decay: float = 0.0
    decay_to: str = "zero"  # zero: theta <- (1 - alpha*wd) theta + step; start: theta - alpha*wd (theta - theta0) + step
    include: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    exclude: list[str] = dataclasses.field(default_factory=list)

    def validate(self, key: str = "es") -> None:
        check(self.population >= 1, f"{key}.population", f"must be >= 1, got {self.population}")
        check(not self.mirrored or self.population % 2 == 0, f"{key}.population",
              f"mirrored sampling needs an even population, got {self.population}")
        check(self.steps >= 1, f"{key}.steps", f"must be >= 1, got {self.steps}")
        self.sigma.validate(f"{key}.sigma")
        self.alpha.validate(f"{key}.alpha")
        check(self.sigma.start > 0, f"{key}.sigma.start",
              f"a training schedule needs sigma > 0, got {self.sigma.start}")
        check_choice(self.shaping, SHAPINGS, f"{key}.shaping")
        check_choice(self.restore, RESTORE_MODES, f"{key}.restore")
        check_choice(self.master, MASTER_MODES, f"{key}.master")
        check(self.chunk_elems >= MIN_CHUNK_ELEMS, f"{key}.chunk_elems",
              f"must be >= {MIN_CHUNK_ELEMS}, got {self.chunk_elems}")
        check_choice(self.noise_backend, NOISE_BACKENDS, f"{key}.noise_backend")
        check_choice(self.noise, NOISE_MODES, f"{key}.noise")
        check(1 <= self.rank <= MAX_RANK, f"{key}.rank", f"must be in 1..{MAX_RANK}, got {self.rank}")
        check(not self.member_batch or self.noise == "lowrank", f"{key}.member_batch",
              "members share one batch through their low-rank terms: needs es.noise=lowrank")
        check(not self.member_batch or self.restore == "snapshot" or self.master == "fp32_host", f"{key}.member_batch",
              "members in one batch never perturb the weights, while a subtract restore's replay re-applies every "
              "member's perturb and restore: use es.restore=snapshot (the default)")
        check(math.isfinite(self.weight_decay) and self.weight_decay >= 0, f"{key}.weight_decay",
              f"must be finite and >= 0, got {self.weight_decay}")
        check_choice(self.decay_to, DECAY_TARGETS, f"{key}.decay_to")
