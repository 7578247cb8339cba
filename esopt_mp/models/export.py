"""Export the in-memory model as a plain HF directory, one tensor at a time, by one writer.

Only data-parallel group 0 takes part (every dp group holds the same
weights). Its tp ranks gather each tensor in turn (``DTensor.full_tensor`` on
the tp group); global rank 0 alone keeps it, in host memory, until the
safetensors shard file it belongs to is written. Host memory at export is
therefore bounded by one shard file (``max_shard_bytes``, or the largest
tensor if bigger) plus one gathered tensor, not by the model.

The directory is what ``save_pretrained`` writes: the checkpoint's own keys
(see :mod:`esopt_mp.models.names`), tied weights stored once under the key
transformers keeps, ``model.safetensors`` or numbered shards with
``model.safetensors.index.json``, ``config.json``, ``generation_config.json``
and the tokenizer.
"""
from __future__ import annotations

import json
import logging
import os

import torch

from esopt_mp.models.loading import _as_dtensor
from esopt_mp.runfiles import fresh_dir, remove_path

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
WEIGHTS_PATTERN = "model{suffix}.safetensors"
INDEX = "model.safetensors.index.json"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # a DTensor reports its global numel


def export_entries(model, names=None) -> dict[str, torch.Tensor]:
    """Checkpoint key -> tensor (a DTensor when sharded; nothing is copied), as ``save_pretrained`` keys it.

    Tied aliases are dropped the way ``save_pretrained`` drops them
    (``remove_tied_weights_from_state_dict``), then every module name is
    mapped to its checkpoint key; a name without one raises, naming it.
    """
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    from esopt_mp.models.names import checkpoint_names

    names = checkpoint_names(model) if names is None else names
    state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)
    out = {}
    for module_name, t in state.items():
        key = names[module_name]
        if key in out:
            raise ValueError(f"two tensors export under the checkpoint key {key!r} (one is {module_name})")
        out[key] = t
    return out


def _write_config(model, out: str) -> None:
    cfg = model.config.__class__.from_dict(model.config.to_dict())
    if hasattr(cfg, "distributed_config"):
        cfg.distributed_config = None  # the export is a plain, unsharded checkpoint
    cfg.dtype = str(model.dtype).split(".")[1]
    cfg.architectures = [type(model).__name__]
    cfg.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)


def export_hf(model, tokenizer, out_dir: str, dims, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              names=None) -> str | None:
    """Write ``out_dir`` (replaced atomically) on global rank 0; returns it there, None elsewhere.

    Every rank of dp group 0 must call this (the tp ranks join each gather);
    ranks of other dp groups return at once.
    """
    from huggingface_hub import split_state_dict_into_shards_factory
    from safetensors.torch import save_file

    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    if dims.dp_rank != 0:
        return None
    writer = dims.rank == 0
    entries = export_entries(model, names)
    split = split_state_dict_into_shards_factory(entries, get_storage_size=_nbytes, filename_pattern=WEIGHTS_PATTERN,
                                                 max_shard_size=max_shard_bytes)
    tmp = out_dir + ".tmp"
    if writer:
        fresh_dir(tmp)
    for filename, keys in split.filename_to_tensors.items():
        shard = {}
        for key in keys:  # the same order on every tp rank: each gather is a collective
            t = entries[key]
            d = _as_dtensor(t)
            full = d.full_tensor() if d is not None else t
            if writer:
                shard[key] = full.detach().to("cpu").contiguous()
            del full
        if writer:
            save_file(shard, os.path.join(tmp, filename), metadata={"format": "pt"})
        del shard
    if not writer:
        return None
    if split.is_sharded:
        index = {"metadata": {"total_parameters": sum(t.numel() for t in entries.values()), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        with open(os.path.join(tmp, INDEX), "w") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    _write_config(model, tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    remove_path(out_dir)  # the previous export, or a link there (removed, not followed)
    os.replace(tmp, out_dir)
    log.info("exported %d tensors in %d file(s) to %s", len(entries), len(split.filename_to_tensors), out_dir)
    return out_dir
