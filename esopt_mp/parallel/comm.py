"""What an ES step communicates: G returns, and now and then a checksum per shard.

Nothing of size O(parameters) crosses the network. Every collective here goes
through :class:`CommStats`, so bytes per step are a measured figure.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.distributed as dist

from esopt_mp.parallel.dims import ParallelDims

NOT_MINE, VALID, FAILED = 0.0, 1.0, 2.0


@dataclasses.dataclass
class CommStats:
    """Bytes this rank sent and received in ES collectives (ring/gather accounting)."""

    sent: int = 0
    received: int = 0
    calls: int = 0

    def add_all_gather(self, local_bytes: int, world: int) -> None:
        self.sent += local_bytes * (world - 1)
        self.received += local_bytes * (world - 1)
        self.calls += 1

    @property
    def total(self) -> int:
        return self.sent + self.received


def gather_returns(local: dict[int, float], population: int, dims: ParallelDims,
                   stats: CommStats | None = None) -> np.ndarray:
    """All G returns on every rank, from each dp group's TP leader, in one all-gather.

    ``local`` maps the members this dp group evaluated to their returns (NaN
    for a failed episode). Each member must be reported by exactly one leader.
    """
    buf = torch.zeros(population, 2, dtype=torch.float64)
    if dims.is_tp_leader:
        for m, r in local.items():
            buf[m, 0] = r if math.isfinite(r) else 0.0
            buf[m, 1] = VALID if math.isfinite(r) else FAILED
    if dims.distributed:
        out = torch.empty(dims.world_size * population, 2, dtype=torch.float64)
        dist.all_gather_into_tensor(out, buf, group=dims.group("world"))
        if stats is not None:
            stats.add_all_gather(buf.numel() * buf.element_size(), dims.world_size)
        table = out.view(dims.world_size, population, 2)
    else:
        table = buf.view(1, population, 2)
    reported = (table[:, :, 1] != NOT_MINE).sum(0)
    if not torch.all(reported == 1):
        bad = [m for m in range(population) if int(reported[m]) != 1]
        raise RuntimeError(f"members {bad} were reported by {[int(reported[m]) for m in bad]} ranks; expected 1 each")
    flag = table[:, :, 1].amax(0)
    value = table[:, :, 0].sum(0)
    return torch.where(flag == VALID, value, torch.full_like(value, math.nan)).numpy()


class ReplicaDriftError(RuntimeError):
    """Data-parallel replicas of a shard no longer hold the same weights."""


def shard_checksum(t: torch.Tensor, chunk: int = 1 << 22) -> int:
    """Exact 63-bit checksum of a tensor's bit pattern, position-weighted, in O(chunk) memory."""
    flat = t.detach().reshape(-1)
    int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    total = 0
    for a in range(0, flat.numel(), chunk):
        bits = flat[a : a + chunk].view(int_dtype).to(torch.int64)
        pos = torch.arange(a, a + bits.numel(), dtype=torch.int64) % 65521 + 1
        total = (total + int((bits * pos).sum()) + int(bits.sum())) & ((1 << 63) - 1)
    return total


def check_replicas(named: list[tuple[str, torch.Tensor]], dims: ParallelDims, stats: CommStats | None = None) -> None:
    """Compare each local shard's checksum across the dp group; raise naming the drifted tensors."""
    if not dims.distributed or dims.dp == 1:
        return
    local = torch.tensor([shard_checksum(t) for _, t in named], dtype=torch.int64)
    out = torch.empty(dims.dp * local.numel(), dtype=torch.int64)
    dist.all_gather_into_tensor(out, local, group=dims.group("dp"))
    if stats is not None:
        stats.add_all_gather(local.numel() * 8, dims.dp)
    table = out.view(dims.dp, -1)
    drifted = [(name, table[:, i].tolist()) for i, (name, _) in enumerate(named) if not torch.all(table[:, i] == table[0, i])]
    if drifted:
        lines = "; ".join(f"{name} (checksums by dp rank: {sums})" for name, sums in drifted[:10])
        raise ReplicaDriftError(
            f"data-parallel replicas drifted (tp rank {dims.tp_rank}): {len(drifted)} tensor(s) differ: {lines}"
        )
