"""An episode's own copy of the process-global random generators, for libraries that draw from them.

TextArena and GEM seed and draw from the process-global ``random`` (GEM also ``np.random``) at reset and in
steps (2048 spawns tiles, Minesweeper lays mines). :func:`owning` runs a library call under one process-wide
lock on the episode's saved generator states and restores the caller's afterwards: an episode plays the same
whatever runs beside it, and nobody else's draws move. One lock for every adapter, since they share the same
globals. (The trainer's own streams are private ``random.Random`` instances and torch generators.)
"""
from __future__ import annotations

import contextlib
import random
import threading

_LOCK = threading.Lock()


class GlobalRandom:
    """An episode's saved states of ``random`` (and ``np.random`` with ``numpy=True``); None until first used."""

    def __init__(self, numpy: bool = False):
        self.numpy, self.state = numpy, None


@contextlib.contextmanager
def owning(rng: GlobalRandom):
    """Run the block under the lock on ``rng``'s saved states (the caller's as they are, on first use), the
    caller's states restored after, ``rng``'s kept for the next call."""
    np = None
    if rng.numpy:
        import numpy as np
    with _LOCK:
        outer = random.getstate(), np.random.get_state() if np else None
        try:
            if rng.state is not None:
                random.setstate(rng.state[0])
                if np:
                    np.random.set_state(rng.state[1])
            yield
        finally:
            rng.state = random.getstate(), np.random.get_state() if np else None
            random.setstate(outer[0])
            if np:
                np.random.set_state(outer[1])
