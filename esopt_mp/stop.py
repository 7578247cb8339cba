"""The stop request a scheduler sends (SIGUSR1 / SIGTERM): a flag the run loop reads at its step boundaries.

Torch-free, so a launcher can install it before anything heavy is imported: a signal that comes while torch, the
model or the first evaluation loads stops the run (exit 75, requeued), where Python's default would kill it.
"""
from __future__ import annotations

import contextlib
import logging
import signal

log = logging.getLogger("esopt_mp.runner")
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Stop:
    """A stop request: the run checkpoints after the current step and returns (before its first step if none has
    begun). A repeated signal changes nothing: under ``srun torchrun`` a worker may get the scheduler's SIGTERM
    and the agent's copy of it at once. Outside the run loop (a peer that never joins, a hung teardown) only
    SIGINT or SIGKILL ends the process. ``requested`` may be set directly (a test's stop)."""

    def __init__(self, requested: bool = False):
        self.requested = requested

    def __call__(self, signum, frame) -> None:
        if not self.requested:
            log.warning("signal %d: the run stops at its next step boundary, after saving what it has", signum)
        self.requested = True


def install(stop: Stop) -> dict:
    """``stop`` handles the stop signals from now on; the handlers it replaced (a C library's: the default)."""
    return {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}


def restore(previous: dict) -> None:
    """Put back the handlers :func:`install` replaced (one installed outside Python: the default)."""
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def stop_on_signals(stop: Stop):
    """``stop`` handles the stop signals while the block runs; the handlers before it come back after."""
    previous = install(stop)
    try:
        yield stop
    finally:
        restore(previous)
