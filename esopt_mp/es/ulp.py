"""Measuring what low precision does to weights: distances in units in the last place (tests and benchmarks)."""
from __future__ import annotations

import torch


def ulp_of(x: torch.Tensor) -> torch.Tensor:
    """Spacing of ``x.dtype`` at each value of ``x`` (float64), subnormal spacing near zero."""
    fi = torch.finfo(x.dtype)
    mag = x.double().abs().clamp_min(fi.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * fi.eps


def ulp_drift(current: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max, RMS) of |current - reference| in ulps of ``reference``'s dtype at the reference value."""
    if current.shape != reference.shape:
        raise ValueError(f"shapes differ: {tuple(current.shape)} vs {tuple(reference.shape)}")
    d = (current.double() - reference.double()).abs() / ulp_of(reference)
    if d.numel() == 0:
        return 0.0, 0.0
    return float(d.max()), float(d.pow(2).mean().sqrt())
