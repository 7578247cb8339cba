"""Step-size schedules for sigma (perturbation scale) and alpha (learning rate)."""
from __future__ import annotations

import dataclasses
import math

from esopt_mp.typed import check, check_choice

KINDS = ("cosine", "constant", "linear")


def check_schedule(kind: str, start: float, end: float, steps: int | None, key: str = "schedule") -> None:
    """The one check of a schedule's settings (``es.sigma`` / ``es.alpha`` and :class:`Schedule` alike)."""
    check_choice(kind, KINDS, f"{key}.kind")
    for k, v in (("start", start), ("end", end)):
        check(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0, f"{key}.{k}",
              f"must be finite and >= 0, got {v!r}")
    check(steps is None or steps >= 1, f"{key}.steps", f"must be >= 1, got {steps}")


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
        check_schedule(self.kind, self.start, self.end, self.steps)

    def __call__(self, t: int) -> float:
        if t < 0:
            raise ValueError(f"step must be >= 0, got {t}")
        x = min(t, self.steps) / self.steps
        if self.kind == "constant":
            return float(self.start)
        if self.kind == "linear":
            return self.start + (self.end - self.start) * x
        return self.end + (self.start - self.end) * (1.0 + math.cos(math.pi * x)) / 2.0
