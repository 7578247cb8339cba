"""Fitness shaping: member returns -> update weights.

A member whose return is not finite (a failed episode) gets weight 0 and is
left out of the statistics of the others.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from esopt_mp.es.config import SHAPINGS
from esopt_mp.typed import check_choice


def shape_returns(returns: Sequence[float], method: str = "zscore", eps: float = 1e-8) -> np.ndarray:
    """Weights for ``returns`` (float64).

    - ``zscore``: (R - mean) / (std + eps), population std (ddof 0) -- the paper's default;
    - ``centered_rank``: ranks mapped linearly onto [-0.5, 0.5], ties averaged;
    - ``raw``: the returns themselves.
    """
    if method not in SHAPINGS:
        check_choice(method, SHAPINGS, "es.shaping")  # the config's own line
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    r = np.asarray(returns, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"returns must be a non-empty 1-D sequence, got shape {r.shape}")
    valid = np.isfinite(r)
    w = np.zeros_like(r)
    v = r[valid]
    if v.size == 0:
        return w
    if method == "zscore":
        w[valid] = (v - v.mean()) / (v.std() + eps)
    elif method == "centered_rank":
        if v.size > 1:
            order = np.argsort(v, kind="stable")
            ranks = np.empty(v.size)
            ranks[order] = np.arange(v.size, dtype=np.float64)
            for value in np.unique(v):  # average the ranks of ties
                tie = v == value
                ranks[tie] = ranks[tie].mean()
            w[valid] = ranks / (v.size - 1) - 0.5
    else:
        w[valid] = v
    return w
