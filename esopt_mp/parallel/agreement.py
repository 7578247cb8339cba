"""What the ranks agree on: the G returns of a step, one verdict on a failure, that replicas hold equal weights.

Nothing of size O(parameters) crosses the network. Both go through
``dims.comm`` (:mod:`esopt_mp.parallel.collectives`), which puts the tensors on
the backend's device and counts their bytes.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from esopt_mp.parallel.dims import ParallelDims

NOT_MINE, VALID, FAILED = 0.0, 1.0, 2.0


def first_failure(dims: ParallelDims, line: str | tuple | None) -> tuple[int, object, int] | None:
    """(rank, line, ranks failed) of the lowest rank whose ``line`` is set, else None: every rank's verdict at once.

    One all-gather of each rank's error line (None: it succeeded), called by every rank before any may enter the
    next collective: a rank that failed alone would otherwise leave its peers waiting in that collective for
    ``parallel.timeout_s``. One process: no collective.
    """
    lines = dims.comm.all_gather_object(line) if dims.world_size > 1 else [line]
    failed = [(r, x) for r, x in enumerate(lines) if x is not None]
    return (failed[0][0], failed[0][1], len(failed)) if failed else None


def gather_returns(local: dict[int, float], population: int, dims: ParallelDims) -> np.ndarray:
    """All G returns on every rank, from each dp group's TP leader, in one all-gather.

    ``local`` maps the members this dp group evaluated to their returns (NaN
    for a failed episode). Each member must be reported by exactly one leader.
    """
    buf = torch.zeros(population, 2, dtype=torch.float64)
    if dims.is_tp_leader:
        for m, r in local.items():
            buf[m, 0] = r if math.isfinite(r) else 0.0
            buf[m, 1] = VALID if math.isfinite(r) else FAILED
    table = dims.comm.all_gather(buf, "world")  # (world, population, 2), on the host
    reported = (table[:, :, 1] != NOT_MINE).sum(0)
    if not torch.all(reported == 1):
        bad = [m for m in range(population) if int(reported[m]) != 1]
        raise RuntimeError(f"members {bad} were reported by {[int(reported[m]) for m in bad]} ranks; expected 1 each")
    flag = table[:, :, 1].amax(0)
    value = table[:, :, 0].sum(0)
    return torch.where(flag == VALID, value, torch.full_like(value, math.nan)).numpy()


# what gloo, NCCL and the store say when a peer process is gone (gloo raises a plain RuntimeError)
_LOST_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
              "nccl communicator was aborted", "socket timeout", "timed out")


def lost_peer(e: BaseException) -> str | None:
    """The first line of a collective's error when it says a peer is gone (killed, its node lost), else None: a
    rank's own bug keeps its traceback, a peer's death is one line on the survivors (the launcher says which
    rank died)."""
    dist_error = getattr(torch.distributed, "DistError", ())
    if not isinstance(e, dist_error) and not (isinstance(e, RuntimeError) and any(
            s in str(e).lower() for s in _LOST_PEER)):
        return None
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return first[:300]


class ReplicaDriftError(RuntimeError):
    """Data-parallel replicas of a shard no longer hold the same weights."""


def shard_checksum(t: torch.Tensor, chunk: int = 1 << 22) -> int:
    """Exact 63-bit checksum of a tensor's bit pattern, position-weighted, in O(chunk) memory.

    Computed on the tensor's own device; int64 sums wrap modulo 2**64, which is
    associative, so CPU and CUDA give the same value.
    """
    flat = t.detach().reshape(-1)
    int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    total = 0
    for a in range(0, flat.numel(), chunk):
        bits = flat[a : a + chunk].view(int_dtype).to(torch.int64)
        pos = torch.arange(a, a + bits.numel(), dtype=torch.int64, device=bits.device) % 65521 + 1
        total = (total + int((bits * pos).sum()) + int(bits.sum())) & ((1 << 63) - 1)
    return total


def check_replicas(named: list[tuple[str, torch.Tensor]], dims: ParallelDims) -> None:
    """Compare each local shard's checksum across the dp group; raise naming the drifted tensors."""
    if not dims.distributed or dims.dp == 1:
        return
    local = torch.tensor([shard_checksum(t) for _, t in named], dtype=torch.int64)
    table = dims.comm.all_gather(local, "dp")
    drifted = [(name, table[:, i].tolist()) for i, (name, _) in enumerate(named) if not torch.all(table[:, i] == table[0, i])]
    # drift may show on some tp ranks only: agree over the world, so every rank raises (none waits in a collective)
    if dims.comm.any(bool(drifted)):
        lines = "; ".join(f"{name} (checksums by dp rank: {sums})" for name, sums in drifted[:10])
        raise ReplicaDriftError(
            f"data-parallel replicas drifted (tp rank {dims.tp_rank}): {len(drifted)} tensor(s) differ here"
            + (f": {lines}" if drifted else "; another tp rank's shards differ (see its error)")
        )
