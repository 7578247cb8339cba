"""Low-rank ES noise (``es.noise=lowrank``): each matrix's perturbation is a rank-r product, not a dense tensor.

For a 2-D canonical tensor ``name`` of shape (m, n) and rank r, member seed s perturbs it by
``sigma * E`` with ``E = A B^T / sqrt(r)``, where A (m x r) is the layout-invariant noise (:mod:`esopt_mp.es.noise`)
of a virtual canonical tensor ``name + A_SUFFIX`` of shape (m, r), and B (n x r) that of ``name + B_SUFFIX`` of
shape (n, r), both under seed s. Every element of E has unit variance, like the full-rank eps. A rank holding rows
[o0, o0 + l0) and columns [o1, o1 + l1) of the matrix regenerates rows [o0, o0 + l0) of A and rows [o1, o1 + l1) of
B: a column-parallel shard its rows of A and all of B, a row-parallel shard all of A and its rows of B.

Why: a member is then (m + n) r numbers per matrix instead of m n, so a whole population can be evaluated in one
batched forward (:mod:`esopt_mp.engine.members`) with the base weights shared, as EGGROLL does.

Tensors of any other rank (norms, biases, 3-D convolution weights) are not perturbed in this mode, and not updated
except by the weight decay.

The arithmetic is fixed so that every layout rounds alike: an element of E (or of an update's sum over members) is
the sum over k, in order, of elementwise products ``(c a_ik) b_jk`` in fp32, never a matrix product whose reduction
order depends on the kernel's blocking. A shard's rows or a chunk's rows then get the same bits whatever the split.
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from esopt_mp.es.noise import Ranges, local_noise
from esopt_mp.es.shard import ShardInfo

A_SUFFIX, B_SUFFIX = "#lowrank.a", "#lowrank.b"


def applies(info: ShardInfo) -> bool:
    """Whether the low-rank mode perturbs this tensor (2-D canonical tensors only)."""
    return len(info.global_shape) == 2


def factor_infos(info: ShardInfo, rank: int) -> tuple[ShardInfo, ShardInfo]:
    """Where the local slice of ``info`` finds its rows of A and of B (the factors' own canonical boxes)."""
    if not applies(info):
        raise ValueError(f"{info.name}: low-rank noise takes 2-D tensors, got shape {info.global_shape}")
    (m, n), (o0, o1), (l0, l1) = info.global_shape, info.offset, info.local_shape
    return (ShardInfo(info.name + A_SUFFIX, (m, rank), (o0, 0), (l0, rank)),
            ShardInfo(info.name + B_SUFFIX, (n, rank), (o1, 0), (l1, rank)))


def factors(seed: int, info: ShardInfo, rank: int, *, device=None, backend: str = "eager"
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of member ``seed`` for ``info``'s local slice: float32 [l0, r] and [l1, r]."""
    fa, fb = factor_infos(info, rank)
    return (local_noise(seed, fa, device=device, backend=backend),
            local_noise(seed, fb, device=device, backend=backend))


def scale(rank: int) -> float:
    """1 / sqrt(r): E's elements have unit variance."""
    return 1.0 / math.sqrt(rank)


def accumulate_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, coeff: float) -> torch.Tensor:
    """``acc += coeff * a b^T`` in place, as r ordered elementwise passes (``acc`` [rows, cols] fp32, ``a`` [rows,
    r], ``b`` [cols, r]): the same bits for any split of the rows."""
    for k in range(a.shape[1]):
        acc.add_(torch.mul((a[:, k] * coeff)[:, None], b[None, :, k]))
    return acc


def row_chunks(info: ShardInfo, chunk_elems: int) -> Iterator[tuple[int, int]]:
    """Row ranges [r0, r1) of the local matrix of at most ``chunk_elems`` elements (at least one row)."""
    rows, cols = info.local_shape
    step = max(1, chunk_elems // max(cols, 1))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def add_(tensor: torch.Tensor, info: ShardInfo, a: torch.Tensor, b: torch.Tensor, scale_: float, rank: int,
         chunk_elems: int) -> None:
    """``tensor += scale_ * A B^T / sqrt(r)`` (the local slice), row chunk by row chunk through an fp32 accumulator,
    rounded into the tensor once."""
    cols = info.local_shape[1]
    flat = tensor.view(-1)
    coeff = scale_ * scale(rank)
    for r0, r1 in row_chunks(info, chunk_elems):
        acc = torch.zeros(r1 - r0, cols, dtype=torch.float32, device=tensor.device)
        accumulate_(acc, a[r0:r1], b, coeff)
        flat[r0 * cols : r1 * cols].add_(acc.view(-1))


def summed(info: ShardInfo, facs: list[tuple[torch.Tensor, torch.Tensor, float]], scale_: float, rank: int,
           chunk_elems: int, buf: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
    """An update's step ``scale_ * sum_i w_i A_i B_i^T / sqrt(r)`` over ``facs`` = [(A_i, B_i, w_i)], as (local flat
    start, stop, fp32 step) per row chunk, in ``buf`` (reused: consume each before the next). A rank-G r sum: no
    member's dense noise is ever formed."""
    cols = info.local_shape[1]
    for r0, r1 in row_chunks(info, chunk_elems):
        acc = buf[: (r1 - r0) * cols].view(r1 - r0, cols).zero_()
        for a, b, w in facs:
            accumulate_(acc, a[r0:r1], b, w * scale(rank))
        acc.mul_(scale_)
        yield r0 * cols, r1 * cols, acc.view(-1)


class FactorBank:
    """Every low-rank shard's (A, B) of one member from one kernel call, as :func:`factors` gives them.

    A shard's rows of a factor are one contiguous range of the factor's global row-major order (whole rows of
    width r), so all of them are one :class:`~esopt_mp.es.noise.Ranges`: the same values bit for bit, without a
    kernel call (and its Python) per factor per member, which on a model of many small matrices costs more than
    the noise.
    """

    def __init__(self, infos: list[ShardInfo], rank: int, device, backend: str = "eager"):
        fs = [f for info in infos for f in factor_infos(info, rank)]  # A, B of each shard in turn
        self.rows = [f.local_shape[0] for f in fs]
        self.rank = rank
        self.ranges = Ranges([(f.tid, f.offset[0] * rank, f.local_shape[0] * rank) for f in fs], device,
                             "compile" if backend == "compile" else "eager")

    def factors(self, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(A, B)] of member ``seed``, one per shard given, views of one float32 buffer."""
        m = [z.view(n, self.rank) for (_, z), n in zip(self.ranges.views(self.ranges.normals(seed)), self.rows)]
        return list(zip(m[0::2], m[1::2]))
