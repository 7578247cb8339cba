"""Load a HF causal LM onto the tp sub-mesh and describe every local tensor.

transformers' native tensor parallelism (``DistributedConfig``) builds its
mesh over the *whole* world. ES needs TP inside each data-parallel group, so
:func:`load_model` hands transformers a mesh manager whose ``tp`` view is this
rank's dp group (:mod:`esopt_mp.models.transformers_patch`, the one patch of a
transformers class); everything else (the model's own ``base_model_tp_plan``,
sharded loading, DTensor parameters) is transformers' code path unchanged.
"""
from __future__ import annotations

import fnmatch
import logging
import os

import torch

from esopt_mp.models.config import DTYPES as MODEL_DTYPES
from esopt_mp.es.shard import LocalShard, ShardInfo
from esopt_mp.parallel.dims import ParallelDims
from esopt_mp.typed import check_choice

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in MODEL_DTYPES}  # model.dtype's choices (models/config.py)


def _as_dtensor(p):
    from torch.distributed.tensor import DTensor

    d = p.data if isinstance(p, torch.nn.Parameter) else p
    return d if isinstance(d, DTensor) else None


def load_model(path: str, dims: ParallelDims, dtype: str = "float32"):
    """``AutoModelForCausalLM`` from a local directory: sharded when tp > 1, else whole on every rank."""
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model.path {path!r} is not a local directory (nothing is downloaded)")
    check_choice(dtype, MODEL_DTYPES, "model.dtype")
    kwargs = dict(dtype=DTYPES[dtype], local_files_only=True)
    if dims.tp > 1:
        from transformers.distributed import DistributedConfig

        from esopt_mp.models.transformers_patch import patch_transformers_tp_mesh

        dc = DistributedConfig(tp_size=dims.tp, tp_plan=attention_plan(path, dims.tp))
        with patch_transformers_tp_mesh(dims, dc):
            model = AutoModelForCausalLM.from_pretrained(path, distributed_config=dc, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        if dims.device_type == "cuda":
            model = model.to(torch.device("cuda", torch.cuda.current_device()))
    model.eval()
    model.requires_grad_(False)
    return model


ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def attention_plan(path: str, tp: int) -> dict[str, str] | None:
    """The tp plan's override for a model whose attention heads ``tp`` does not divide (SmolLM2-135M: 9 heads, 3 KV
    heads; Gemma-3-270M: 4 heads, 1 KV head): its attention projections replicated on every tp rank (each rank
    computes every head; the MLP, embeddings and lm_head stay sharded) instead of split inside a head, which
    transformers' head-wise plan would do and its forward cannot run. None (the model's own plan) otherwise."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if not heads or (heads % tp == 0 and kv % tp == 0):
        return None
    try:
        prefix = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].base_model_prefix
    except KeyError:
        return None  # not a causal LM transformers maps: from_pretrained says so
    rules = [k for k in (getattr(text, "base_model_tp_plan", None) or {})
             if k.rsplit(".", 1)[-1] in ATTENTION_PROJECTIONS]
    if not rules:
        return None  # the plan does not split attention by head
    if type(config) is not type(text):  # a text model nested in a multimodal one: its plan keys are prefixed otherwise
        raise ValueError(f"parallel.tp={tp} does not divide the model's {heads} attention heads / {kv} KV heads and "
                         f"esopt_mp replicates attention only in a plain causal LM: set parallel.tp to a divisor of "
                         f"both")
    log.info("parallel.tp=%d does not divide the model's %d attention heads / %d KV heads: its attention "
             "projections are replicated on every tp rank, the rest of the model sharded", tp, heads, kv)
    return {f"{prefix}.{k}" if prefix else k: "replicate" for k in rules}


def selected(name: str, include=("*",), exclude=()) -> bool:
    """es.include / es.exclude: glob patterns on the canonical (checkpoint) name."""
    return any(fnmatch.fnmatchcase(name, p) for p in include) and not any(fnmatch.fnmatchcase(name, p) for p in exclude)


def _local_box(name: str, d) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, local shape) of a DTensor's local tensor; only Replicate and plain Shard are boxes.

    ``_StridedShard`` (packed / interleaved projections) and ``Partial`` hold
    elements that are not one box of the global tensor, so the noise slice
    computed from an offset would be wrong; refuse them rather than guess.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for pl in d.placements:
        if type(pl) not in (Replicate, Shard):
            raise ValueError(
                f"{name}: placement {pl!r} (of {tuple(d.placements)}) is not supported; ES noise slices need "
                f"Replicate or Shard(dim) placements. Exclude the tensor with es.exclude or change the tp plan"
            )
    local_shape, offset = compute_local_shape_and_global_offset(d.shape, d.device_mesh, d.placements)
    return tuple(offset), tuple(local_shape)


def build_shards(model: torch.nn.Module, include=("*",), exclude=(), names=None) -> list[LocalShard]:
    """Each selected parameter's local tensor with (canonical name, global shape, global slice).

    Canonical names are the keys of the checkpoint the model was loaded from
    (``names``: a :class:`~esopt_mp.models.names.CheckpointNames`, by default
    built from ``model.name_or_path``), which may differ from module names
    after transformers' load-time renaming. ``include``/``exclude`` are glob
    patterns on the canonical name. Tied parameters appear once (the tensor
    under its first module name). Sharded parameters are DTensors: their slice
    comes from the placements; replicated ones cover the whole tensor.
    """
    from esopt_mp.models.names import checkpoint_names

    names = checkpoint_names(model) if names is None else names
    shards = []
    for module_name, p in model.named_parameters():  # named_parameters() yields a tied tensor once
        name = names[module_name]
        if not selected(name, include, exclude):
            continue
        d = _as_dtensor(p)
        if d is None:
            shards.append(LocalShard(p.data, ShardInfo.full(name, p.shape)))
        else:
            offset, local_shape = _local_box(module_name, d)
            shards.append(LocalShard(d.to_local(), ShardInfo(name, tuple(d.shape), offset, local_shape)))
    if not shards:
        raise ValueError(f"es.include={list(include)} / es.exclude={list(exclude)} select no parameter")
    return shards


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every state-dict entry unsharded on CPU, tied ones included (a collective per sharded tensor).

    For tests and small models: it holds the whole model in host memory on
    every rank; exports stream instead (:mod:`esopt_mp.models.export`).
    """
    out, seen = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        d = _as_dtensor(t)
        key = id(t)  # a tied entry is the same Parameter object
        if key not in seen:
            seen[key] = (d.full_tensor() if d is not None else t.data).detach().cpu().clone()
        out[name] = seen[key]
    return out
