"""Counter-based Gaussian noise that is the same whatever the sharding.

eps for member seed ``s`` is a pure function of (s, canonical tensor name,
row-major element index in the unsharded tensor) (docs/concepts.md, "The noise"):
Philox4x32-10 keyed by ``s``, counter ``(j // 4, tid)``, Box-Muller in float64,
element ``j`` takes output ``j % 4``. A rank holding any box-shaped slice of a
tensor (a row shard, a column shard, the whole tensor) regenerates exactly its
slice without materialising anything larger than one block.

A local slice is a set of equal-length *runs* that are contiguous both in the
local tensor and in the global row-major order (whole rows of a column shard,
the whole tensor when nothing is sliced); :func:`stream` walks them in blocks.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from esopt_mp.es.backend import resolve as resolve_backend
from esopt_mp.es.philox import get_kernel, key_words, tensor_id
from esopt_mp.es.shard import ShardInfo

DEFAULT_BLOCK = 1 << 16


def _runs_normals(kernel, words: torch.Tensor, starts: torch.Tensor, length: int, device) -> torch.Tensor:
    """float32 [R, L]: normals at global indices starts[r] + 0..L-1."""
    rows = starts.numel()
    lanes = starts % 4
    lo, hi = int(lanes.min()), int(lanes.max())
    ncount = (hi + length + 3) // 4
    q = (starts // 4).to(device)[:, None] + torch.arange(ncount, dtype=torch.int64, device=device)
    z = kernel(q.reshape(-1), words).view(rows, 4 * ncount)
    if lo == hi:
        return z[:, lo : lo + length]
    out = torch.empty(rows, length, dtype=torch.float32, device=device)
    for lane in range(lo, hi + 1):
        sel = (lanes == lane).to(device)
        out[sel] = z[sel, lane : lane + length]
    return out


def stream(
    seed: int,
    info: ShardInfo,
    start: int = 0,
    stop: int | None = None,
    *,
    block: int = DEFAULT_BLOCK,
    device=None,
    backend: str = "eager",
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (local flat offset p, eps [R, L]) covering local elements [start, stop) of ``info``.

    ``backend``: see :mod:`esopt_mp.es.backend` (all give the same eps; triton yields [1, L] blocks).

    ``eps.reshape(-1)`` belongs at ``local_flat[p : p + R * L]``. Extra memory is O(block).
    """
    stop = info.numel if stop is None else stop
    if not 0 <= start <= stop <= info.numel:
        raise ValueError(f"{info.name}: local range [{start}, {stop}) outside 0..{info.numel}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    device = torch.device("cpu") if device is None else torch.device(device)
    backend = resolve_backend(backend, device, stop - start)
    if backend == "triton":  # eps straight from the kernel, one flat block at a time
        from esopt_mp.es import triton_noise
        for a in range(start, stop, block):
            out = torch.empty(min(stop, a + block) - a, dtype=torch.float32, device=device)
            yield a, triton_noise.axpy_(out, seed, info, None, start=a).view(1, -1)
        return
    kernel = get_kernel(backend)
    words = key_words(seed, info.tid, device)
    for p, starts, length in info.blocks(start, stop, block):
        yield p, _runs_normals(kernel, words, starts, length, device)


def fill_(out: torch.Tensor, seed: int, info: ShardInfo, *, scale: float = 1.0, accumulate: bool = False,
          block: int = DEFAULT_BLOCK, backend: str = "eager") -> torch.Tensor:
    """Write (or add, with ``accumulate``) ``scale * eps`` of ``info``'s slice into ``out`` in place."""
    if tuple(out.shape) != info.local_shape:
        raise ValueError(f"{info.name}: out has shape {tuple(out.shape)}, slice is {info.local_shape}")
    if not out.is_contiguous():
        raise ValueError(f"{info.name}: out must be contiguous")
    flat = out.view(-1)
    for p, z in stream(seed, info, block=block, device=out.device, backend=backend):
        dst = flat[p : p + z.numel()].view_as(z)
        if accumulate:
            dst.add_(z, alpha=scale)
        else:
            dst.copy_(z)
            if scale != 1.0:
                dst.mul_(scale)
    return out


def local_noise(seed: int, info: ShardInfo, *, device=None, block: int = DEFAULT_BLOCK,
                backend: str = "eager") -> torch.Tensor:
    """eps for ``info``'s local slice as a new float32 tensor."""
    out = torch.empty(info.local_shape, dtype=torch.float32, device=device)
    return fill_(out, seed, info, block=block, backend=backend)


def gaussian(seed: int, name: str, index: torch.Tensor, *, backend: str = "eager") -> torch.Tensor:
    """eps at row-major element indices ``index`` of the canonical tensor ``name`` (float32, index's shape)."""
    if index.dtype != torch.int64:
        raise TypeError(f"index must be int64 (torch.long), got {index.dtype}")
    if index.numel() and int(index.min()) < 0:
        raise ValueError("element indices must be non-negative")
    flat = index.reshape(-1)
    words = key_words(seed, tensor_id(name), index.device)
    z = get_kernel(backend)(flat // 4, words)
    return z.gather(1, (flat % 4)[:, None]).view(index.shape)


class Ranges:
    """The noise at contiguous ranges of several tensors' row-major indices, from one kernel call per seed.

    Each range ``(tid, start, count)`` takes the counters its elements need (``start // 4`` onward), laid end to
    end with its own tensor id, so one call covers them all and every element gets exactly the value
    :func:`stream` gives it (the same function of seed, tensor id and counter). Precomputed: the counters and the
    tensor-id words, ~10 bytes per element.
    """

    def __init__(self, ranges: list[tuple[int, int, int]], device, backend: str):
        device = torch.device(device)
        qs, tids, counts = [], [], []
        self.offsets, self.counts = [], []  # of each range's first element in the normals, its length
        size = 0
        for tid, start, count in ranges:
            q0, q1 = start // 4, (start + max(count, 1) - 1) // 4 + 1
            qs.append(torch.arange(q0, q1, dtype=torch.int64))
            tids.append(tid)
            counts.append(q1 - q0)
            self.offsets.append(size + start - 4 * q0)
            self.counts.append(count)
            size += 4 * (q1 - q0)
        self.size = size  # of the normals (each range padded to whole counters)
        self.q = torch.cat(qs).to(device)
        tid = torch.tensor([[t & 0xFFFFFFFF, t >> 32] for t in tids], dtype=torch.int64)
        reps = torch.tensor(counts)
        self.words = torch.empty(4, int(reps.sum()), dtype=torch.int64, device=device)
        self.words[2] = tid[:, 0].repeat_interleave(reps).to(device)
        self.words[3] = tid[:, 1].repeat_interleave(reps).to(device)
        self.kernel = get_kernel(backend)

    def normals(self, seed: int) -> torch.Tensor:
        """Flat float32 normals; range k's are ``[offsets[k] : offsets[k] + counts[k]]`` of it."""
        key = key_words(seed, 0, self.words.device)
        self.words[0].fill_(key[0])
        self.words[1].fill_(key[1])
        return self.kernel(self.q, self.words).view(-1)

    def views(self, z: torch.Tensor):
        """(index among the ranges, that range's flat slice of ``z``)."""
        for k, (o, n) in enumerate(zip(self.offsets, self.counts)):
            yield k, z[o : o + n]


class WholeTensors(Ranges):
    """The noise of several small whole tensors from one kernel call per seed.

    A model's norms, biases and small projections are many tensors of a few thousand elements; generating each
    one's noise apart costs a kernel call (and its Python) per tensor per member, which at the size of a small agent
    costs more than the noise itself: each tensor is one range (:class:`Ranges`).
    """

    def __init__(self, infos: list[ShardInfo], device, backend: str):
        if not infos or any(not i.is_full for i in infos):
            raise ValueError("WholeTensors takes whole (unsliced) tensors")
        super().__init__([(i.tid, 0, i.numel) for i in infos], device, backend)


def group_whole_tensors(shards, eligible: list[bool], backends: dict, block: int) -> list[tuple[WholeTensors, list[int]]]:
    """Small whole ``eligible`` shards on one device (a noise block or less each), in groups of at most ``block``
    elements: one kernel call per group per seed instead of one per tensor (:class:`WholeTensors`); (group, the
    shards' indices) for groups of two or more."""
    by_device: dict = {}
    for k, s in enumerate(shards):
        if eligible[k] and s.info.is_full and s.info.numel <= block:
            by_device.setdefault(s.tensor.device, []).append(k)
    out = []
    for dev, ks in by_device.items():
        group: list[int] = []
        size = 0  # the group's elements
        for k in [*ks, None]:
            n = 0 if k is None else shards[k].info.numel
            if group and (k is None or size + n > block):
                if len(group) > 1:
                    out.append((WholeTensors([shards[j].info for j in group], dev, backends[dev]), group))
                group, size = [], 0
            if k is not None:
                group.append(k)
                size += n
    return out
