"""Canonical mapping of a serving engine's fused, sharded runtime tensors (data, not code per layer).

vLLM holds ``qkv_proj`` (q, k, v rows of this tp rank, concatenated),
``gate_up_proj``, Qwen3.5's ``in_proj_qkvz`` / ``in_proj_ba``, vocab-parallel
embeddings padded to a multiple of 64 rows, and so on. The noise spec is keyed
by checkpoint names and global indices (:mod:`esopt_mp.es.noise`), so each local
runtime tensor is described as a list of :class:`Piece`: a contiguous range of
its flattened elements that is one box of one checkpoint tensor, in that box's
row-major order. Padding elements belong to no piece (they get no noise and are
never exported).

The mapping is not written by hand per architecture: :func:`decode_probe` reads
it off runtime tensors that the engine's own weight loaders filled with *index
tensors* (element value = position in the checkpoint tensor, offset per key),
so every fusion, interleave, padding or replication the engine applies is
captured as it is. What is not a box-wise copy is refused by name: a row that
is not a run of consecutive elements (a transposed load) here, and a loader
that shifts or scales values by the probe's second encoding (vllm_worker).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re

import torch

from esopt_mp.es.shard import LocalShard, ShardInfo
from esopt_mp.models.loading import selected

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class MappingError(ValueError):
    """A runtime tensor the canonical mapping cannot describe."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened runtime tensor ``param`` = box ``info`` of a checkpoint tensor."""

    param: str
    start: int
    stop: int
    info: ShardInfo

    def view(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """This piece of its runtime tensor (in ``tensors``), shaped as its box: a view, no copy."""
        return tensors[self.param].view(-1)[self.start : self.stop].view(self.info.local_shape)

    def to_json(self) -> dict:
        i = self.info
        return {"param": self.param, "start": self.start, "stop": self.stop, "name": i.name,
                "global_shape": list(i.global_shape), "offset": list(i.offset), "shape": list(i.local_shape)}

    @classmethod
    def from_json(cls, d: dict) -> "Piece":
        return cls(d["param"], d["start"], d["stop"], ShardInfo(d["name"], d["global_shape"], d["offset"], d["shape"]))


def layer_of(name: str) -> int:
    """Layer number in a parameter or checkpoint name (-1 outside the decoder stack): the probe's grouping."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else -1


def index_tensor(shape, base: int, stride: int = 1) -> torch.Tensor:
    """float64 tensor whose element j (row-major) is ``base + stride * j``: exact up to 2**53."""
    n = math.prod(shape)
    if base + stride * n >= 1 << 53:
        raise MappingError(f"probe offsets reach {base + stride * n}: beyond float64's exact integers")
    return torch.arange(n, dtype=torch.float64).mul_(stride).add_(base).view(*shape)


def _row_boxes(param: str, vals: torch.Tensor, starts: torch.Tensor, order: list[str],
               shapes: dict[str, tuple], stride: int = 1) -> list[Piece]:
    """Split one runtime tensor's probe values (float64, its own shape) into pieces, vectorised over rows.

    A runtime "row" is one index of dim 0 (a 1-D tensor is rows of one
    element). Each row must be a run of consecutive indices of one checkpoint
    tensor inside one row of it (or whole rows of its inner dims); consecutive
    rows that continue the same box merge into one piece.
    """
    rows = vals.reshape(vals.shape[0], -1) if vals.dim() > 1 else vals.reshape(-1, 1)
    n_rows, width = rows.shape
    unloaded = torch.isnan(rows) | (rows == 0)  # NaN: untouched scratch; 0: padding a loader zero-filled
    dead, partial = unloaded.all(1), unloaded.any(1) & ~unloaded.all(1)
    if bool(partial.any()):
        raise MappingError(f"{param}: row {int(partial.nonzero()[0])} is partly loaded from the checkpoint and partly not")
    live = ~dead
    first = torch.where(live, rows[:, 0], torch.zeros((), dtype=torch.float64))
    step = torch.arange(width, dtype=torch.float64) * stride
    bad = live & ~((rows - first[:, None]) == step).all(1)
    if bool(bad.any()):
        raise MappingError(f"{param}: row {int(bad.nonzero()[0])} is not a run of consecutive checkpoint elements "
                           f"(a transposed or transformed load): no canonical mapping")
    if bool((live & (first != first.round())).any()):
        raise MappingError(f"{param}: probe values are not integers (a transformed load): no canonical mapping")
    ki = (torch.searchsorted(starts, first, right=True) - 1).clamp(min=0)
    off = first - starts[ki]
    if bool((live & (off.remainder(stride) != 0)).any()):
        raise MappingError(f"{param}: probe values fall between encoded elements (a transformed load): no mapping")
    j = off.div(stride).long()
    numel = torch.tensor([math.prod(shapes[k]) for k in order], dtype=torch.long)
    inner = torch.tensor([math.prod(shapes[k][1:]) if len(shapes[k]) > 1 else 1 for k in order], dtype=torch.long)
    is1d = torch.tensor([len(shapes[k]) == 1 for k in order])
    if bool((live & ((first < starts[0]) | (j + width > numel[ki]))).any()):
        raise MappingError(f"{param}: probe values decode to no checkpoint element (a transformed load)")
    gr = torch.where(is1d[ki], j, j // inner[ki])
    col = torch.where(is1d[ki], torch.zeros_like(j), j % inner[ki])
    if bool((live & ~is1d[ki] & (col + width > inner[ki])).any()):
        raise MappingError(f"{param}: a row crosses a row boundary of its checkpoint tensor")
    rowstep = torch.where(is1d[ki], torch.full_like(j, width), torch.ones_like(j))
    cont = torch.zeros(n_rows, dtype=torch.bool)
    if n_rows > 1:
        cont[1:] = (live[1:] & live[:-1] & (ki[1:] == ki[:-1]) & (gr[1:] == gr[:-1] + rowstep[:-1])
                    & (col[1:] == col[:-1]))
    heads = (live & ~cont).nonzero().flatten().tolist()
    pieces = []
    for h in heads:
        r1 = h + 1
        while r1 < n_rows and bool(cont[r1]):
            r1 += 1
        key, nr, g0, c0 = order[int(ki[h])], r1 - h, int(gr[h]), int(col[h])
        g = tuple(shapes[key])
        if len(g) == 1:
            info = ShardInfo(key, g, (g0,), (nr * width,))
        elif width == math.prod(g[1:]):
            info = ShardInfo(key, g, (g0,) + (0,) * (len(g) - 1), (nr,) + g[1:])
        elif len(g) == 2:
            info = ShardInfo(key, g, (g0, c0), (nr, width))
        else:
            raise MappingError(f"{param}: rows of {width} elements are a partial slice of {key}'s inner dims "
                               f"{g[1:]}; only whole inner rows or 2-D column slices map")
        pieces.append(Piece(param, h * width, r1 * width, info))
    return pieces


def decode_probe(probed: dict[str, torch.Tensor], keys: dict[str, tuple], bases: dict[str, int],
                 stride: int = 1) -> list[Piece]:
    """Pieces of every probed runtime tensor; ``bases[key] + stride * j`` encoded element j of ``key``.

    ``probed`` holds float64 copies of the runtime tensors after the engine's
    loaders wrote the index tensors into NaN-filled scratch (NaN = not loaded).
    """
    order = sorted(bases, key=bases.get)
    starts = torch.tensor([bases[k] for k in order], dtype=torch.float64)
    pieces = []
    for param, vals in probed.items():
        got = _row_boxes(param, vals, starts, order, keys, stride)
        if not got:
            raise MappingError(f"runtime tensor {param} receives nothing from the checkpoint: no canonical mapping")
        pieces.extend(got)
    check_disjoint(pieces)
    return pieces


def check_disjoint(pieces: list[Piece]) -> None:
    """No checkpoint element appears twice on one rank (its noise would be applied twice)."""
    by_name: dict[str, list[ShardInfo]] = {}
    for p in pieces:
        by_name.setdefault(p.info.name, []).append(p.info)
    for name, infos in by_name.items():
        for a, b in itertools.combinations(infos, 2):
            if all(max(x, y) < min(x + n, y + m) for x, n, y, m in zip(a.offset, a.local_shape, b.offset, b.local_shape)):
                raise MappingError(f"{name}: boxes {a.offset}+{a.local_shape} and {b.offset}+{b.local_shape} overlap "
                                   f"on one rank")


def select(pieces: list[Piece], include=("*",), exclude=()) -> list[Piece]:
    """The pieces ES perturbs: es.include / es.exclude as the hf engine applies them (models.loading.selected)."""
    return [p for p in pieces if selected(p.info.name, include, exclude)]


def local_shards(pieces: list[Piece], tensors: dict[str, torch.Tensor]) -> list[LocalShard]:
    """Views of the runtime tensors, one per piece, shaped as its box: what the Perturber works on in place."""
    for p in pieces:
        if not tensors[p.param].is_contiguous():
            raise MappingError(f"runtime tensor {p.param} is not contiguous")
    return [LocalShard(p.view(tensors), p.info) for p in pieces]


def gather_pieces(pieces: list[Piece], tensors: dict[str, torch.Tensor]) -> dict[str, list[tuple[ShardInfo, torch.Tensor]]]:
    """Checkpoint name -> [(box, values)] read from runtime tensors (for checkpoint-format reloads and exports)."""
    out: dict[str, list] = {}
    for p in pieces:
        out.setdefault(p.info.name, []).append((p.info, p.view(tensors)))
    return out


def box_slices(info: ShardInfo) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(info.offset, info.local_shape))


def describe(pieces: list[Piece]) -> str:
    """One line per piece: runtime tensor[start:stop] <- checkpoint name[box]."""
    lines = []
    for p in pieces:
        box = ", ".join(f"{o}:{o + n}" for o, n in zip(p.info.offset, p.info.local_shape))
        lines.append(f"{p.param}[{p.start}:{p.stop}] <- {p.info.name}[{box}] of {tuple(p.info.global_shape)}")
    return "\n".join(lines)
