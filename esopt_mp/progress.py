"""Per-step progress on rank 0: a tqdm bar on a terminal, one plain log line per step anywhere else.

A batch job's ``.out`` file is not a terminal: a bar's carriage returns and cursor-up escapes would fill it
with half-lines, so there each step is one line a person (or ``grep``) reads: step, returns, sigma (the
baselines: KL), the held-out score when the step evaluated, the step's time and the ETA.
"""
from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("esopt_mp.progress")


def interactive() -> bool:
    """Is stderr (where bars and the log go) a terminal?"""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


def quiet_libraries() -> None:
    """Off a terminal, no library draws a progress bar either (transformers' weight loading, hub downloads)."""
    if interactive():
        return
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()


def eta(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def step_line(name: str, t: int, total: int, rec: dict, held_out: float | None, left_s: float) -> str:
    """``ES step 3/40 | return 0.2500 mean, 0.7500 max | sigma 9.8e-04 | 4.1 s/step | ETA 2m36s``."""
    parts = [f"{name.upper()} step {t + 1}/{total}",
             f"return {rec['return_mean']:.4f} mean, {rec.get('return_max', float('nan')):.4f} max"]
    for k in ("sigma", "kl"):
        if isinstance(rec.get(k), (int, float)):
            parts.append(f"{k} {rec[k]:.1e}")
    if held_out is not None:
        parts.append(f"held-out {held_out:.4f}")
    failed = {k: v for k, v in (rec.get("episodes_failed") or {}).items() if v}
    if failed:
        parts.append("failed episodes " + ", ".join(f"{v} {k}" for k, v in failed.items()))
    again = rec.get("retried") or {}
    if any(again.values()):
        e, m = again.get("episodes", 0), again.get("members", 0)
        parts.append(f"played again: {e} episode{'s' * (e != 1)}, {m} member{'s' * (m != 1)}")
    if isinstance(rec.get("step_s"), (int, float)):
        parts.append(f"{rec['step_s']:.1f} s/step")
    parts.append(f"ETA {eta(left_s)}")
    return " | ".join(parts)


class StepProgress:
    """Rank 0's view of the steps ``start .. total - 1``; silent elsewhere."""

    def __init__(self, name: str, start: int, total: int, enabled: bool, bar: bool | None = None):
        self.name, self.start, self.total, self.enabled = name, start, total, enabled
        self.t0 = time.perf_counter()
        self.bar = None
        if enabled and (interactive() if bar is None else bar):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start, desc=f"{name.upper()} steps", dynamic_ncols=True)

    def step(self, t: int, rec: dict, held_out: float | None = None) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(ret=f"{rec['return_mean']:.4f}", **{k: f"{rec[k]:.1e}" for k in ("sigma", "kl")
                                                                     if isinstance(rec.get(k), (int, float))})
            return
        done = t + 1 - self.start
        left = (time.perf_counter() - self.t0) / done * (self.total - t - 1)
        log.info("%s", step_line(self.name, t, self.total, rec, held_out, left))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
