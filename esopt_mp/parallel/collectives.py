"""The one place where ranks talk: every torch.distributed collective of esopt_mp runs here.

NCCL takes CUDA tensors only, gloo takes CPU tensors (CUDA for a few ops), and
callers hold tensors wherever their data lives (returns and checksums on the
host, model tensors on the GPU). :class:`Collectives` moves each tensor to the
backend's device (``dims.comm_device``: ``cuda:<local>`` for NCCL, ``cpu`` for
gloo), runs the collective there, hands the result back on the caller's
device, and counts the bytes at the call (:class:`CommStats`).

Byte accounting per rank, for a payload of ``b`` bytes over ``n`` ranks:
all-gather sends and receives ``b * (n - 1)`` (ring); all-reduce sends and
receives ``2 b (n - 1) / n`` (ring); a broadcast's source sends ``b * (n - 1)``
and every other rank receives ``b``. ``tools/bench_comm.py`` checks these
counts against the kernel's own loopback counters.

What the ranks agree on through them: the G returns of a step (one all-gather), one verdict on a failure (the
lowest failing rank's line), that replicas hold equal weights. Nothing of size O(parameters) crosses the network.
"""
from __future__ import annotations

import dataclasses
import math
import pickle
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from esopt_mp.parallel.dims import ParallelDims


_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


@dataclasses.dataclass
class CommStats:
    """Bytes this rank sent and received in collectives, in total and per operation."""

    sent: int = 0
    received: int = 0
    calls: int = 0
    by_op: dict = dataclasses.field(default_factory=dict)  # op -> [calls, sent + received]

    def add(self, op: str, sent: float, received: float) -> None:
        sent, received = int(round(sent)), int(round(received))
        self.sent += sent
        self.received += received
        self.calls += 1
        c = self.by_op.setdefault(op, [0, 0])
        c[0] += 1
        c[1] += sent + received

    @property
    def total(self) -> int:
        return self.sent + self.received

    def copy(self) -> "CommStats":
        return CommStats(self.sent, self.received, self.calls, {k: list(v) for k, v in self.by_op.items()})

    def __sub__(self, other: "CommStats") -> "CommStats":
        ops = {k: [v[0] - other.by_op.get(k, [0, 0])[0], v[1] - other.by_op.get(k, [0, 0])[1]]
               for k, v in self.by_op.items()}
        return CommStats(self.sent - other.sent, self.received - other.received, self.calls - other.calls,
                         {k: v for k, v in ops.items() if v[0]})


def _all_gather_single():
    """torch >= 2.13 names it ``all_gather_single`` (deprecating ``all_gather_into_tensor``)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Collectives:
    """all_gather / all_reduce / broadcast_object / barrier over a dims group ("dp", "tp" or "world").

    Without a process group (world 1) every call is local and counts nothing.
    """

    def __init__(self, dims):
        self.dims = dims
        self.device = dims.comm_device
        self.stats = CommStats()

    def _size(self, dim: str) -> int:
        return {"dp": self.dims.dp, "tp": self.dims.tp, "world": self.dims.world_size}[dim]

    def _local(self, dim: str) -> bool:
        return not self.dims.distributed or self._size(dim) == 1

    def all_gather(self, t: torch.Tensor, dim: str = "world") -> torch.Tensor:
        """Every rank's ``t`` of ``dim``'s group stacked in group-rank order: shape ``(n, *t.shape)``."""
        if self._local(dim):
            return t.unsqueeze(0).clone()
        n = self._size(dim)
        x = t.detach().to(self.device).contiguous()
        out = torch.empty((n * x.shape[0], *x.shape[1:]) if x.dim() else (n,), dtype=x.dtype, device=self.device)
        _all_gather_single()(out, x if x.dim() else x.view(1), group=self.dims.group(dim))
        b = x.numel() * x.element_size()
        self.stats.add("all_gather", b * (n - 1), b * (n - 1))
        return out.view(n, *t.shape).to(t.device)

    def all_reduce(self, t: torch.Tensor, op: str = "sum", dim: str = "world") -> torch.Tensor:
        """Elementwise ``op`` (sum | max | min) of ``t`` over ``dim``'s group; a new tensor on t's device."""
        if op not in _OPS:
            raise ValueError(f"all_reduce op must be one of {sorted(_OPS)}, got {op!r}")
        if self._local(dim):
            return t.clone()
        n = self._size(dim)
        x = t.detach().to(self.device, copy=True).contiguous()
        dist.all_reduce(x, op=getattr(dist.ReduceOp, _OPS[op]), group=self.dims.group(dim))
        b = x.numel() * x.element_size()
        self.stats.add("all_reduce", 2 * b * (n - 1) / n, 2 * b * (n - 1) / n)
        return x.to(t.device)

    def any(self, flag: bool, dim: str = "world") -> bool:
        """True on every rank if ``flag`` is true on any rank (one all-reduce MAX of one byte)."""
        return bool(self.all_reduce(torch.tensor([int(bool(flag))], dtype=torch.uint8), "max", dim)[0])

    def broadcast_object(self, obj=None, src: int = 0, dim: str = "tp"):
        """``obj`` of global rank ``src`` on every rank of ``dim``'s group (pickled; length, then bytes)."""
        if self._local(dim):
            return obj
        n, group = self._size(dim), self.dims.group(dim)
        mine = self.dims.rank == src
        data = pickle.dumps(obj) if mine else b""
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        dist.broadcast(length, src=src, group=group)
        size = int(length.item())
        if mine:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        dist.broadcast(buf, src=src, group=group)
        b = size + 8
        self.stats.add("broadcast", b * (n - 1) if mine else 0, 0 if mine else b)
        return obj if mine else pickle.loads(buf.cpu().numpy().tobytes())

    def all_gather_object(self, obj, dim: str = "world") -> list:
        """Every rank's ``obj`` of ``dim``'s group, in group-rank order (pickled; lengths, then padded bytes)."""
        if self._local(dim):
            return [obj]
        n, group = self._size(dim), self.dims.group(dim)
        data = pickle.dumps(obj)
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        lengths = torch.empty(n, dtype=torch.int64, device=self.device)
        _all_gather_single()(lengths, length, group=group)
        size = int(lengths.max().item())
        buf = torch.zeros(size, dtype=torch.uint8, device=self.device)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        out = torch.empty(n * size, dtype=torch.uint8, device=self.device)
        _all_gather_single()(out, buf, group=group)
        self.stats.add("all_gather", (size + 8) * (n - 1), (size + 8) * (n - 1))
        rows = out.view(n, size).cpu().numpy()
        return [pickle.loads(rows[r, : int(lengths[r])].tobytes()) for r in range(n)]

    def barrier(self, dim: str = "world") -> None:
        if self._local(dim):
            return
        kwargs = {"device_ids": [self.device.index]} if self.device.type == "cuda" else {}
        dist.barrier(group=self.dims.group(dim), **kwargs)
        self.stats.add("barrier", 0, 0)


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


def failed_on(rank: int, n: int) -> str:
    """Where :func:`first_failure` found a failure, in words: ``rank 1``, ``rank 1 (and 2 other ranks)``."""
    return f"rank {rank}" + (f" (and {n - 1} other rank{'s' if n > 2 else ''})" if n > 1 else "")


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
