"""The perturber's local shards as torch.distributed.checkpoint (DCP) state: one global tensor per canonical name.

A rank's ES state for a canonical tensor is one or several boxes (global
offset + local tensor): a tp slice of a row- or column-parallel weight, the
whole tensor when it is replicated, or the pieces a fused vLLM runtime tensor
holds. :class:`BoxTensor` presents them to DCP through its checkpointable
protocol (the hooks DTensor implements), so DCP writes each box as a chunk of
the global tensor and, on load, reads any saved chunking into any requested
one: that is what makes a checkpoint written at one dp x tp load at another.
Boxes equal across ranks (replicas) are written once (DCP's save-plan dedup).

DCP's own ``.metadata`` is a pickle, and unpickling a file runs whatever code
it names. So a checkpoint carries a JSON description instead
(:func:`metadata_to_json`: every tensor's dtype, global shape and chunks, each
chunk's file, offset and length), from which :func:`metadata_from_json`
rebuilds DCP's ``Metadata`` after checking every field, and
:class:`JsonMetadataReader` hands it to ``dcp.load``; the pickle is never read.
The chunks themselves are read by DCP with torch's weights-only loader.

No collective here: saving and loading are driven by :mod:`esopt_mp.checkpoint` and :mod:`esopt_mp.resume`.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

JSON_FORMAT = 1  # of the JSON description (metadata_to_json)
DATA_FILE = re.compile(r"__\d+_\d+\.distcp")  # DCP's data files: a plain name inside the checkpoint directory
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


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


def metadata_to_json(md: Metadata) -> dict:
    """DCP's metadata of a save of :func:`box_state_dict` as plain JSON data (tensors only, default properties)."""
    tensors: dict[str, dict] = {}
    for fqn, tmd in md.state_dict_metadata.items():
        if not isinstance(tmd, TensorStorageMetadata) or tmd.properties != TensorProperties(dtype=tmd.properties.dtype):
            raise ValueError(f"{fqn}: only plain tensors can be described ({type(tmd).__name__})")
        chunks = []
        for c in tmd.chunks:
            info = md.storage_data[MetadataIndex(fqn, c.offsets)]
            if info.transform_descriptors:
                raise ValueError(f"{fqn}: stream transforms {info.transform_descriptors} are not supported")
            chunks.append({"offsets": list(c.offsets), "sizes": list(c.sizes), "file": info.relative_path,
                           "offset": info.offset, "length": info.length})
        tensors[fqn] = {"dtype": str(tmd.properties.dtype).removeprefix("torch."), "size": list(tmd.size),
                        "chunks": chunks}
    return {"format": JSON_FORMAT, "dcp_version": md.version, "tensors": tensors}


MAX_CHUNKS = 4096  # boxes of one tensor in a checkpoint: tp x vLLM-style split boxes stay far below


def _ints(v, n: int | None, what: str) -> list[int]:
    if not isinstance(v, list) or (n is not None and len(v) != n) or \
            not all(type(x) is int and x >= 0 for x in v):  # noqa: E721 (bool is not a size)
        raise ValueError(f"{what} must be a list of {n if n is not None else 'some'} non-negative integers, got {v!r}")
    return v


def metadata_from_json(obj, where: str) -> Metadata:
    """DCP's ``Metadata`` rebuilt from :func:`metadata_to_json`'s data; ``ValueError`` naming the field otherwise.

    Checked: known dtypes only, chunks inside their tensor and disjoint (whether
    they cover what a rank needs is :func:`check_coverage`'s), each in a plain
    data file name of this directory with a non-negative offset and length.
    Nothing in it is executed or imported.
    """
    if not isinstance(obj, dict) or obj.get("format") != JSON_FORMAT or not isinstance(obj.get("tensors"), dict):
        raise ValueError(f"{where}: not a format-{JSON_FORMAT} checkpoint description")
    state, storage = {}, {}
    for fqn, t in obj["tensors"].items():
        what = f"{where}: tensor {fqn!r}"
        if not isinstance(t, dict) or t.get("dtype") not in DTYPES or not isinstance(t.get("chunks"), list) \
                or not t["chunks"]:
            raise ValueError(f"{what}: needs a dtype among {sorted(DTYPES)} and a non-empty chunk list")
        if len(t["chunks"]) > MAX_CHUNKS:  # the pairwise disjointness check below must stay cheap
            raise ValueError(f"{what}: {len(t['chunks'])} chunks, more than any layout writes ({MAX_CHUNKS})")
        size = _ints(t.get("size"), None, f"{what} size")
        boxes = []
        for i, c in enumerate(t["chunks"]):
            cw = f"{what} chunk {i}"
            if not isinstance(c, dict) or not isinstance(c.get("file"), str) or not DATA_FILE.fullmatch(c["file"]):
                raise ValueError(f"{cw}: its file must be a DCP data file name (__<rank>_<n>.distcp)")
            off, sz = _ints(c.get("offsets"), len(size), f"{cw} offsets"), _ints(c.get("sizes"), len(size),
                                                                                 f"{cw} sizes")
            _ints([c.get("offset"), c.get("length")], 2, f"{cw} offset and length")
            if any(o + n > d for o, n, d in zip(off, sz, size)):
                raise ValueError(f"{cw}: {off} + {sz} lies outside the tensor's size {size}")
            if any(_overlap(off, sz, o2, n2) for o2, n2 in boxes):
                raise ValueError(f"{cw}: overlaps another chunk")
            boxes.append((off, sz))
            index = MetadataIndex(fqn, torch.Size(off))
            storage[index] = _StorageInfo(c["file"], c["offset"], c["length"])
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=DTYPES[t["dtype"]]), torch.Size(size),
                                           [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in boxes])
    version = obj.get("dcp_version")
    return Metadata(state, storage_data=storage, version=version if isinstance(version, str) else None)


class JsonMetadataReader(FileSystemReader):
    """DCP's file reader with its metadata given (from :func:`metadata_from_json`): the ``.metadata`` pickle is
    never opened."""

    def __init__(self, path: str, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self._metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return self._metadata
