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
"""
from __future__ import annotations

import dataclasses
import pickle

import torch
import torch.distributed as dist

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
