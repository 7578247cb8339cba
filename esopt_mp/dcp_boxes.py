"""The perturber's local shards as torch.distributed.checkpoint (DCP) state: one global tensor per canonical name.

A rank's ES state for a canonical tensor is one or several boxes (global
offset + local tensor): a tp slice of a row- or column-parallel weight, the
whole tensor when it is replicated, or the pieces a fused vLLM runtime tensor
holds. :class:`BoxTensor` presents them to DCP through its checkpointable
protocol (the hooks DTensor implements), so DCP writes each box as a chunk of
the global tensor and, on load, reads any saved chunking into any requested
one: that is what makes a checkpoint written at one dp x tp load at another.
Boxes equal across ranks (replicas) are written once (DCP's save-plan dedup).

No collective here: saving and loading are driven by :mod:`esopt_mp.checkpoint`.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class BoxTensor(torch.Tensor):
    """A global tensor of which this rank holds ``boxes``: [(global offset, local tensor)]; nothing else is stored.

    Only DCP's planner touches it (write items, chunk list, shard lookup); it
    is never used in arithmetic.
    """

    @staticmethod
    def __new__(cls, global_shape, boxes: list[tuple[tuple[int, ...], torch.Tensor]]):
        if not boxes:
            raise ValueError("a BoxTensor needs at least one box")
        dtype = boxes[0][1].dtype
        for off, t in boxes:
            if t.dtype != dtype or len(off) != len(global_shape) or t.dim() != len(global_shape):
                raise ValueError(f"box at {off} of shape {tuple(t.shape)} {t.dtype} does not fit a "
                                 f"{tuple(global_shape)} {dtype} tensor")
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(global_shape), dtype=dtype, device=boxes[0][1].device)
        r._boxes = [(torch.Size(off), t) for off, t in boxes]
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"BoxTensor is a checkpoint view; {func} is not supported on it")

    def __repr__(self) -> str:  # the default repr would dispatch
        return f"BoxTensor(global_shape={tuple(self.shape)}, boxes={[tuple(o) for o, _ in self._boxes]})"

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.shape),
                                                      properties=props, size=self.shape))
                for off, t in self._boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=off, sizes=t.shape) for off, t in self._boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, t in self._boxes:
            if off == index.offset:
                return t
        raise ValueError(f"{index.fqn}: no local box at offset {tuple(index.offset or ())}")


def box_state_dict(shards, states: list[torch.Tensor]) -> dict[str, BoxTensor]:
    """{canonical name: BoxTensor} over ``states`` (aligned with ``shards``; box-shaped, as the perturber keeps them)."""
    grouped: dict[str, list] = defaultdict(list)
    shape: dict[str, tuple] = {}
    for shard, state in zip(shards, states):
        info = shard.info
        if tuple(state.shape) != tuple(info.local_shape):
            raise ValueError(f"{info.name}: state of shape {tuple(state.shape)}, its box is {tuple(info.local_shape)}")
        if shape.setdefault(info.name, tuple(info.global_shape)) != tuple(info.global_shape):
            raise ValueError(f"{info.name}: shards disagree on the global shape")
        grouped[info.name].append((tuple(info.offset), state))
    return {name: BoxTensor(shape[name], boxes) for name, boxes in grouped.items()}


def _overlap(a_off, a_size, b_off, b_size) -> int:
    return math.prod(max(0, min(a + n, b + m) - max(a, b)) for a, n, b, m in zip(a_off, a_size, b_off, b_size))


def check_coverage(metadata, shards, where: str) -> set[str]:
    """Every box of ``shards`` is covered exactly by the saved chunks in DCP ``metadata``; returns the files read.

    Raises ``ValueError`` naming the tensor when a name is missing, its global
    shape differs, or the saved chunks leave part of a box uncovered (a layout
    that cannot map onto this rank) -- before anything is read.
    """
    md, files = metadata.state_dict_metadata, set()
    for shard in shards:
        info = shard.info
        saved = md.get(info.name)
        if saved is None or not hasattr(saved, "chunks"):
            raise ValueError(f"{where}: no tensor {info.name} (saved with another model or es.include/es.exclude?)")
        if tuple(saved.size) != tuple(info.global_shape):
            raise ValueError(f"{where}: {info.name} was saved with global shape {tuple(saved.size)}, the model has "
                             f"{tuple(info.global_shape)}")
        covered = 0
        for c in saved.chunks:
            n = _overlap(c.offsets, c.sizes, info.offset, info.local_shape)
            if n:
                covered += n
                files.add(metadata.storage_data[MetadataIndex(info.name, c.offsets)].relative_path)
        if covered != math.prod(info.local_shape):
            raise ValueError(f"{where}: the saved chunks of {info.name} cover {covered} of the "
                             f"{math.prod(info.local_shape)} elements of this rank's box at {tuple(info.offset)}; "
                             "this checkpoint's layout cannot map onto the current mesh")
    return files
