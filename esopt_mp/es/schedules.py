"""Step-size schedules for sigma (perturbation scale) and alpha (learning rate)."""
from __future__ import annotations

import dataclasses
import math

KINDS = ("cosine", "constant", "linear")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """``value(t)`` for t in [0, steps]; t beyond ``steps`` holds the end value.

    cosine: ``end + (start - end) * (1 + cos(pi * t / steps)) / 2`` (the paper's
    sigma schedule; train-time ``end > 0``, test-time ``end = 0``).
    """

    kind: str = "cosine"
    start: float = 1e-3
    end: float = 0.0
    steps: int = 100

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown schedule kind {self.kind!r}; expected one of {KINDS}")
        for key in ("start", "end"):
            v = getattr(self, key)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"schedule {key} must be finite and >= 0, got {v!r}")
        if self.steps < 1:
            raise ValueError(f"schedule steps must be >= 1, got {self.steps}")

    def __call__(self, t: int) -> float:
        if t < 0:
            raise ValueError(f"step must be >= 0, got {t}")
        x = min(t, self.steps) / self.steps
        if self.kind == "constant":
            return float(self.start)
        if self.kind == "linear":
            return self.start + (self.end - self.start) * x
        return self.end + (self.start - self.end) * (1.0 + math.cos(math.pi * x)) / 2.0
