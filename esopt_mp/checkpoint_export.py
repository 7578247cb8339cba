"""Reading a checkpoint's tensors whole: the HF export of a run (safetensors, the base model's layout) and tools.

Saving lives in :mod:`esopt_mp.checkpoint`, loading into a mesh and resume in :mod:`esopt_mp.resume`; this reads
its DCP format back into plain tensors, one base file (or one whole checkpoint) at a time.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import torch

from esopt_mp.checkpoint import CheckpointError, check_checkpoint, dcp_metadata
from esopt_mp.dcp_boxes import JsonMetadataReader
from esopt_mp.runfiles import fresh_dir, remove_path

__all__ = ["export_checkpoint", "read_checkpoint"]


def export_checkpoint(path: str, base: str, out_dir: str, dtype: torch.dtype) -> str:
    """A checkpoint (any layout, any engine) + its base model directory -> a plain HF directory (safetensors).

    The base directory's files, keys and layout, with every tensor the
    checkpoint holds read whole through DCP (one base file at a time, cast to
    ``dtype``); tensors ES did not touch are copied from the base. This is how
    the vllm engine exports: canonical tensors, never vLLM's fused names.
    """
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from safetensors.torch import save_file

    check_checkpoint(path, digest=True)
    meta = dcp_metadata(path)  # from chunks.json: nothing is unpickled
    saved = meta.state_dict_metadata
    tmp = out_dir + ".tmp"
    fresh_dir(tmp)
    used, total = set(), 0
    for fname in sorted(os.listdir(base)):
        src = os.path.join(base, fname)
        if not fname.endswith(".safetensors"):
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(tmp, fname))
            continue
        tensors, trained = {}, {}
        with safe_open(src, "pt") as f:
            for key in f.keys():
                if key not in saved:  # untouched by ES: as the base has it
                    tensors[key] = f.get_tensor(key).contiguous()
                    continue
                shape = tuple(f.get_slice(key).get_shape())  # the base's values are not needed
                md = saved[key]
                if tuple(md.size) != shape:
                    raise CheckpointError(f"{path}: {key} saved with global shape {tuple(md.size)}, base has {shape}")
                if sum(math.prod(c.sizes) for c in md.chunks) != math.prod(shape):
                    raise CheckpointError(f"{path}: the saved chunks of {key} do not cover it")
                trained[key] = torch.empty(shape, dtype=md.properties.dtype)
        if trained:
            dcp.load(trained, storage_reader=JsonMetadataReader(path, meta), no_dist=True)
            tensors.update({k: v.to(dtype).contiguous() for k, v in trained.items()})  # ES tensors, served dtype
            used |= set(trained)
        save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    missing = sorted(set(saved) - used)
    if missing:
        raise CheckpointError(f"{path}: tensors {missing[:3]} are not in the base model {base}")
    index = os.path.join(tmp, "model.safetensors.index.json")
    if os.path.isfile(index):  # dtypes may have changed: keep the index's size right
        with open(index) as f:
            idx = json.load(f)
        idx.setdefault("metadata", {})["total_size"] = total
        with open(index, "w") as f:
            json.dump(idx, f, indent=2)
    remove_path(out_dir)  # the previous export, or a link there (removed, not followed)
    os.replace(tmp, out_dir)
    return out_dir


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checked checkpoint, whole, as saved (for tools and tests; a 27B one needs the host memory)."""
    import torch.distributed.checkpoint as dcp

    check_checkpoint(path, digest=True)
    meta = dcp_metadata(path)
    out = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in meta.state_dict_metadata.items()}
    dcp.load(out, storage_reader=JsonMetadataReader(path, meta), no_dist=True)
    return out
