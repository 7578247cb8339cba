"""Shard metadata beside the tensor: where a rank's local tensor sits in its canonical (checkpoint) tensor.

The noise (:mod:`esopt_mp.es.noise`), the perturber, model loading and the runtime engines' weight maps all
describe a local slice the same way, so the noise of an element depends only on its canonical name and index.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from functools import cached_property

import torch

from esopt_mp.es.philox import tensor_id


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """Where a local tensor sits in its canonical (checkpoint) tensor.

    ``offset[d]:offset[d] + local_shape[d]`` is the global slice held along
    dimension ``d``; a replicated tensor has zero offsets and the full shape.
    """

    name: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    local_shape: tuple[int, ...]

    def __post_init__(self):
        g, lo, n = (tuple(int(x) for x in v) for v in (self.global_shape, self.offset, self.local_shape))
        object.__setattr__(self, "global_shape", g)
        object.__setattr__(self, "offset", lo)
        object.__setattr__(self, "local_shape", n)
        if not self.name:
            raise ValueError("ShardInfo needs a canonical tensor name")
        if not len(g) == len(lo) == len(n):
            raise ValueError(f"{self.name}: global_shape {g}, offset {lo} and local_shape {n} differ in rank")
        for d, (gd, od, nd) in enumerate(zip(g, lo, n)):
            if gd < 0 or nd < 0 or od < 0 or od + nd > gd:
                raise ValueError(
                    f"{self.name}: slice [{od}:{od + nd}] of dim {d} lies outside the global shape {g}"
                )

    @classmethod
    def full(cls, name: str, shape) -> "ShardInfo":
        shape = tuple(shape)
        return cls(name, shape, (0,) * len(shape), shape)

    @property
    def numel(self) -> int:
        n = 1
        for x in self.local_shape:
            n *= x
        return n

    @property
    def is_full(self) -> bool:
        return self.local_shape == self.global_shape

    @cached_property
    def tid(self) -> int:
        return tensor_id(self.name)

    @cached_property
    def _runs(self) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], int]:
        """(run length W, outer local shape, outer global offsets, outer global strides, base)."""
        g, lo, n = self.global_shape, self.offset, self.local_shape
        inner, k = 1, len(g) - 1
        while k >= 0 and lo[k] == 0 and n[k] == g[k]:
            inner *= g[k]
            k -= 1
        if k < 0:
            return inner, (), (), (), 0
        strides, s = [0] * k, inner * g[k]
        for d in range(k - 1, -1, -1):
            strides[d] = s
            s *= g[d]
        return n[k] * inner, n[:k], lo[:k], tuple(strides), lo[k] * inner

    def run_starts(self, r0: int, r1: int) -> torch.Tensor:
        """Global flat index of the first element of local runs ``r0..r1-1`` (int64, CPU)."""
        _, outer, olo, ostride, base = self._runs
        idx = torch.arange(r0, r1, dtype=torch.int64)
        start = torch.full_like(idx, base)
        for d in range(len(outer) - 1, -1, -1):
            start += (idx % outer[d] + olo[d]) * ostride[d]
            idx = idx // outer[d]
        return start

    def blocks(self, start: int, stop: int, block: int) -> Iterator[tuple[int, torch.Tensor, int]]:
        """Cover local flat range [start, stop) with (local offset, run starts [R], length L), R*L <= block."""
        width = self._runs[0]
        p = start
        while p < stop:
            r, c = divmod(p, width)
            if c == 0 and width <= block and stop - p >= width:
                nr = min((stop - p) // width, block // width)
                yield p, self.run_starts(r, r + nr), width
                p += nr * width
            else:
                length = min(width - c, stop - p, block)
                yield p, self.run_starts(r, r + 1) + c, length
                p += length


@dataclasses.dataclass
class LocalShard:
    """A local tensor together with where it sits in its canonical tensor."""

    tensor: torch.Tensor
    info: ShardInfo

    def __post_init__(self):
        if tuple(self.tensor.shape) != self.info.local_shape:
            raise ValueError(f"{self.info.name}: tensor shape {tuple(self.tensor.shape)} != {self.info.local_shape}")
        if not self.tensor.is_floating_point():
            raise ValueError(f"{self.info.name}: ES perturbs floating-point tensors, got {self.tensor.dtype}")
        if not self.tensor.is_contiguous():
            raise ValueError(f"{self.info.name}: local tensor must be contiguous")


def build_local_shards(module: torch.nn.Module, include=None) -> list[LocalShard]:
    """Shards of an unsharded module: every parameter whole, under its own name.

    Tied parameters appear once (under the first name), as in a checkpoint.
    ``include`` is an optional predicate on the name.
    """
    return [
        LocalShard(p.data, ShardInfo.full(name, p.shape))
        for name, p in module.named_parameters()
        if include is None or include(name)
    ]
