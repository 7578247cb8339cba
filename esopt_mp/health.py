"""Say loudly when an ES run has stopped learning (and stop it, if configured).

Two conditions make an ES step a no-op that nothing else reports: every
member's return is NaN (every episode errored: a broken sandbox, a missing
tool), or all returns are equal (shaped weights all zero). Either one, k steps
in a row, means the run is burning compute on nothing.
"""
from __future__ import annotations

import logging
import math

import numpy as np

log = logging.getLogger(__name__)


class DegenerateRunError(RuntimeError):
    """The run stopped learning for ``run.degenerate_steps`` steps and ``run.stop_on_degenerate`` is set."""


class Health:
    def __init__(self, degenerate_steps: int = 3, stop: bool = False):
        if degenerate_steps < 1:
            raise ValueError(f"run.degenerate_steps must be >= 1, got {degenerate_steps}")
        self.k, self.stop = degenerate_steps, stop
        self.streak = 0
        self.errors: list[str] = []  # member-level errors seen since the last check

    def note_error(self, msg: str) -> None:
        self.errors.append(msg)

    def check(self, step: int, returns, weights, episode_errors=()) -> str | None:
        """The reason step ``step`` learned nothing (None if it did); warns, and raises when configured."""
        r, w = np.asarray(returns, dtype=np.float64), np.asarray(weights, dtype=np.float64)
        errors = (list(self.errors) + list(episode_errors))[:3]
        self.errors = []
        finite = r[np.isfinite(r)]
        if finite.size == 0:
            reason = f"all {r.size} returns are NaN: every episode failed"
        elif np.all(w == 0):
            value = float(finite[0]) if np.all(finite == finite[0]) else math.nan
            reason = (f"all {finite.size} finite returns are equal ({value:g})" if not math.isnan(value)
                      else "all shaped weights are zero") + ": the update is a no-op"
        else:
            self.streak = 0
            return None
        if errors:
            reason += "; sample errors: " + " | ".join(errors)
        self.streak += 1
        if finite.size == 0 or self.streak >= self.k:
            log.error("!!! step %d learned nothing (%d step(s) in a row): %s", step, self.streak, reason)
        if self.stop and self.streak >= self.k:
            raise DegenerateRunError(
                f"stopping: {self.streak} consecutive steps learned nothing (run.degenerate_steps={self.k}, "
                f"run.stop_on_degenerate=true); last: {reason}"
            )
        return reason
