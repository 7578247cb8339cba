"""vLLM worker extension: ES perturb / restore / update on the worker's own runtime tensors, from seeds.

Loaded by vLLM into every worker (``worker_extension_cls``) and driven through
``collective_rpc``: only (seed, sign, sigma) and the step's (seeds, weights,
alpha) cross processes, never weights. Each worker maps its fused, sharded
runtime tensors to checkpoint names and global boxes once
(:mod:`esopt_mp.engine.runtime_map`), then runs the same
:class:`~esopt_mp.es.perturber.Perturber` the hf engine runs, so a member's
noise is the same function of (seed, name, global index) on either engine.

Two ways to make the weights take effect (``sync``):

- ``inplace`` (GPU): the Perturber writes views of vLLM's live parameters.
  Chosen when every mapped runtime tensor is still the tensor the loaders
  wrote (same shape and dtype after ``process_weights_after_loading``).
- ``reload`` (CPU, or anything that repacks weights): the Perturber writes a
  worker-side copy of the runtime tensors (built from the checkpoint through
  the mapping); before the next generation the worker hands vLLM the full
  checkpoint-format state via ``reload_weights`` (a partial reload corrupts
  fused projections).
"""
from __future__ import annotations

import logging
import math
import os

import torch

from esopt_mp.engine.runtime_map import (MappingError, Piece, box_slices, decode_probe, gather_pieces,
                                         index_tensor, layer_of, local_shards, select)
from esopt_mp.es.perturber import Perturber

log = logging.getLogger(__name__)
PROBE_PREFIX = "esopt_probe"


def checkpoint_index(path: str) -> dict[str, tuple[str, tuple]]:
    """Checkpoint key -> (safetensors file, shape), from the file headers (no data read)."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors file (canonical names are its keys)")
    out = {}
    for name in files:
        with safe_open(os.path.join(path, name), "pt") as f:
            for k in f.keys():
                out[k] = (name, tuple(f.get_slice(k).get_shape()))
    return out


def probe_runtime_map(vllm_config, shapes: dict[str, tuple]) -> tuple[list[Piece], dict[str, tuple]]:
    """The worker's (pieces, runtime tensor shapes), read off a meta-device twin of its model.

    The twin is built with the worker's config (so the same tp rank, padding
    and fusions); one decoder layer at a time its parameters become NaN-filled
    float64 scratch, the layer's checkpoint keys are fed to the model's own
    ``load_weights`` as index tensors, and :func:`decode_probe` reads the boxes
    back. Peak extra memory: one layer's local parameters and one checkpoint
    tensor, in float64, on the host (27B's embedding: 10 GB per rank, once at
    startup; ``tools/runtime_map.py`` prints the result).
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    ctx = vllm_config.compilation_config.static_forward_context
    before = set(ctx)
    with set_current_vllm_config(vllm_config), torch.device("meta"):
        twin = initialize_model(vllm_config=vllm_config, model_config=vllm_config.model_config, prefix=PROBE_PREFIX)
    for k in set(ctx) - before:  # the twin's attention layers registered themselves; it never runs
        del ctx[k]
    params = dict(twin.named_parameters())
    runtime_shapes = {n: tuple(p.shape) for n, p in params.items()}
    groups = sorted({layer_of(n) for n in params} | {layer_of(k) for k in shapes})
    pieces: list[Piece] = []
    for g in groups:
        names = [n for n in params if layer_of(n) == g]
        keys = [k for k in shapes if layer_of(k) == g]
        # two encodings (element j of key k -> base_k + stride * j): a loader that shifts or scales values decodes
        # differently under the two and is refused; a plain copy decodes identically
        found = [_probe_group(twin, names, keys, shapes, stride) for stride in (1, 3)]
        if found[0] != found[1]:
            bad = sorted({p.param for p in set(found[0]) ^ set(found[1])})
            raise MappingError(f"runtime tensors {bad[:3]} are not plain copies of checkpoint elements (the loader "
                               f"transforms values): no canonical mapping")
        pieces.extend(found[0])
    return pieces, runtime_shapes  # the prefix names the twin's layers only, not its parameters


def _probe_group(twin, names, keys, shapes, stride: int) -> list[Piece]:
    """One probe pass over one layer's parameters and checkpoint keys (see :func:`probe_runtime_map`)."""
    bases, base = {}, 1  # 0 is what padding is filled with: no index is 0
    for k in keys:
        bases[k] = base
        base += stride * math.prod(shapes[k])
    originals, scratch = {}, {}
    for n in names:
        mod_name, _, attr = n.rpartition(".")
        mod = twin.get_submodule(mod_name)
        old = originals[n] = mod._parameters[attr]
        if not old.is_floating_point() or type(old).__name__.startswith("Packed"):
            raise MappingError(f"{n}: {type(old).__name__} of {old.dtype} (quantized?) has no canonical mapping")
        # same class (vLLM's ModelWeightParameter & co. carry their loaders), float64 NaN data
        new = type(old).__new__(type(old), torch.full(old.shape, math.nan, dtype=torch.float64), requires_grad=False)
        new.__dict__.update(old.__dict__)
        mod._parameters[attr] = scratch[n] = new
    try:
        for k in keys:  # one key at a time: its index tensor is the only full-size tensor alive
            twin.load_weights([(k, index_tensor(shapes[k], bases[k], stride))])
        probed = {n: p.data for n, p in scratch.items()}
        for n in names:
            if bool(torch.isnan(probed[n]).all()):
                raise MappingError(f"runtime tensor {n} receives nothing from the checkpoint: no canonical mapping")
        return decode_probe(probed, {k: shapes[k] for k in keys}, bases, stride)
    finally:  # the meta parameters (with their loaders) come back; this layer's scratch is freed
        for n, old in originals.items():
            mod_name, _, attr = n.rpartition(".")
            twin.get_submodule(mod_name)._parameters[attr] = old


def runtime_from_checkpoint(path: str, index: dict[str, tuple[str, tuple]], pieces: list[Piece],
                            shapes: dict[str, tuple], dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """Runtime tensors built from the checkpoint through the mapping (padding zero): reading only each box.

    ``index``: :func:`checkpoint_index` of ``path``; ``shapes`` / ``dtypes``: per runtime tensor."""
    from safetensors import safe_open

    out = {n: torch.zeros(s, dtype=dtypes[n]) for n, s in shapes.items()}
    by_file: dict[str, list[Piece]] = {}
    for p in pieces:
        by_file.setdefault(index[p.info.name][0], []).append(p)
    for f, ps in by_file.items():
        with safe_open(os.path.join(path, f), "pt") as h:
            for p in ps:
                p.view(out).copy_(h.get_slice(p.info.name)[box_slices(p.info)])
    return out


def checkpoint_format(pieces: list[Piece], tensors: dict[str, torch.Tensor], shapes: dict[str, tuple]):
    """(key, full-shape tensor) for every key this rank maps, its boxes filled: what ``load_weights`` reads."""
    for name, boxes in gather_pieces(pieces, tensors).items():
        full = torch.zeros(shapes[name], dtype=boxes[0][1].dtype, device=boxes[0][1].device)
        for info, vals in boxes:
            full[box_slices(info)].copy_(vals)
        yield name, full


def _alias_modules(model) -> list:
    """Modules whose weight is another module's (tied lm_head): they re-process after a reload."""
    first, out = {}, []
    for name, p in model.named_parameters(remove_duplicate=False):
        mod = model.get_submodule(name.rpartition(".")[0])
        if id(p) in first and first[id(p)] is not mod and getattr(mod, "quant_method", None) is not None:
            out.append(mod)
        first.setdefault(id(p), mod)
    return out


def _live_parameters(model) -> dict:
    """The served model's parameters by vLLM's module names: with LoRA enabled (es.member_batch) a layer's own
    weight sits under ``base_layer``, which is dropped here."""
    return {n.replace(".base_layer.", "."): p for n, p in model.named_parameters()}


def _vllm_layout() -> dict:
    """This worker's place in vLLM's tensor-parallel group (checked against ParallelDims by the engine)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.distributed.parallel_state import get_tp_group

    return {"vllm_tp_rank": get_tensor_model_parallel_rank(), "vllm_tp_size": get_tensor_model_parallel_world_size(),
            "vllm_tp_ranks": list(get_tp_group().ranks)}


class ESWorkerExtension:
    """Methods vLLM mixes into its worker class; called through ``LLM.collective_rpc``."""

    def esopt_setup(self, spec: dict) -> dict:
        """Map the runtime tensors, choose the sync mode, build the Perturber. Returns a summary."""
        path = spec["model_path"]
        index = checkpoint_index(path)
        shapes = {k: shape for k, (_, shape) in index.items()}
        pieces, runtime_shapes = probe_runtime_map(self.vllm_config, shapes)
        live = _live_parameters(self.model_runner.model)
        missing = sorted(set(runtime_shapes) - set(live))
        if missing:
            raise MappingError(f"runtime tensors {missing[:3]} of the probe are not in the served model")
        same = all(tuple(live[n].shape) == runtime_shapes[n] and live[n].is_floating_point() for n in runtime_shapes)
        cuda = all(t.is_cuda for t in live.values())
        sync = spec.get("sync", "auto")
        if sync == "auto":  # on CPU a same-shaped tensor may still sit beside a packed copy vLLM computes with
            sync = "inplace" if same and cuda else "reload"
            if cuda and not same:
                log.warning("vLLM repacked runtime tensors after loading; ES falls back to a full reload_weights "
                            "per weight change (slow for large models)")
        if sync == "inplace" and not same:
            changed = [n for n in runtime_shapes if tuple(live[n].shape) != runtime_shapes[n]][:3]
            raise MappingError(f"engine.weight_sync=inplace, but vLLM repacked {changed} after loading "
                               f"(CPU prepacks every linear layer); use engine.weight_sync=reload or auto")
        # ES runs in the served dtype on every tensor, as the hf engine does; where vLLM keeps a tensor in another
        # dtype (Qwen3.5's A_log in float32 in a bfloat16 model) the worker holds a served-dtype mirror and copies
        # it into vLLM's tensor after every change, so both engines hold the same values
        dtype = self.vllm_config.model_config.dtype
        mirrors = {}
        if sync == "inplace":
            tensors = {n: live[n].data for n in runtime_shapes}
            for n in runtime_shapes:
                if live[n].dtype != dtype:
                    mirrors[n] = tensors[n] = live[n].data.to(dtype)
        else:
            tensors = runtime_from_checkpoint(path, index, pieces, runtime_shapes, {n: dtype for n in runtime_shapes})
        chosen = select(pieces, spec.get("include", ("*",)), spec.get("exclude", ()))
        if not chosen:
            raise ValueError("es.include / es.exclude select no tensor of the vLLM model")
        self._esopt = {"pieces": pieces, "chosen": chosen, "shapes": shapes, "tensors": tensors, "sync": sync,
                       "dirty": False, "aliases": _alias_modules(self.model_runner.model), "mirrors": mirrors,
                       "live": live}
        self._esopt_perturber = Perturber(local_shards(chosen, tensors), restore=spec.get("restore", "snapshot"),
                                          master=spec.get("master", "none"),
                                          chunk_elems=spec.get("chunk_elems", 1 << 24),
                                          noise_backend=spec.get("noise_backend", "auto"),
                                          work_passes=spec.get("work_passes"), cache_warm=spec.get("cache_warm"),
                                          noise=spec.get("noise", "full"), rank=spec.get("rank", 1))
        self._esopt_changed()  # the served-dtype values reach vLLM before the first generation
        unmapped = sum(math.prod(s) for s in runtime_shapes.values()) - sum(p.stop - p.start for p in pieces)
        return {"sync": sync, "pieces": len(pieces), "perturbed_pieces": len(chosen),
                "numel": self._esopt_perturber.numel, "unmapped_elements": unmapped,
                "runtime_tensors": len(runtime_shapes), "mirrored": sorted(mirrors),
                "noise_backends": sorted(set(self._esopt_perturber.backends.values())), **_vllm_layout()}

    # ------------------------------------------------------------------ ES ops (seeds in, nothing out)
    def esopt_perturb(self, seed: int, sigma: float, sign: int) -> None:
        self._esopt_perturber.perturb(seed, sigma, sign)
        self._esopt_changed()

    def esopt_restore(self) -> None:
        self._esopt_perturber.restore()
        self._esopt_changed()

    def esopt_update(self, seeds, signs, weights, alpha: float, weight_decay: float, decay_to: str = "zero") -> None:
        p = self._esopt_perturber
        if decay_to == "start" and not p.has_start:
            # theta0 read from the served model's files (the base model the run's identity names), not from the
            # live tensors, which a resume may have loaded a checkpoint into: one transient host copy of the
            # perturbed runtime tensors, then 1x the local shard kept (Perturber.set_start_)
            st, cfg = self._esopt, self.vllm_config.model_config
            names = {pc.param for pc in st["chosen"]}
            start = runtime_from_checkpoint(cfg.model, checkpoint_index(cfg.model), st["chosen"],
                                            {n: tuple(st["tensors"][n].shape) for n in names},
                                            {n: cfg.dtype for n in names})
            p.set_start_([s.tensor for s in local_shards(st["chosen"], start)])
            del start
        p.update(seeds, signs, weights, alpha, weight_decay, decay_to)
        self._esopt_changed()

    def esopt_flush(self) -> bool:
        """Make pending weight changes visible to vLLM (reload mode); True if a reload ran."""
        st = self._esopt
        if st["sync"] != "reload" or not st["dirty"]:
            return False
        self.model_runner.reload_weights(weights_iterator=checkpoint_format(st["pieces"], st["tensors"], st["shapes"]),
                                         is_checkpoint_format=True)
        for mod in st["aliases"]:  # a tied lm_head is never loaded itself, so its prepacked copy would stay stale
            mod.quant_method.process_weights_after_loading(mod)
        st["dirty"] = False
        return True

    def _esopt_changed(self) -> None:
        st = self._esopt
        st["dirty"] = True
        if st["sync"] == "inplace":
            for n, m in st["mirrors"].items():
                st["live"][n].data.copy_(m)
            if torch.cuda.is_available():
                torch.cuda.synchronize()

    def esopt_live_check(self) -> dict:
        """After a flush: vLLM's own tensors that still hold plain weights (not prepacked) vs the ES values.

        Proves that what ES wrote reached vLLM, not just the worker's copy: returns how many live tensors could
        be compared and how many elements differ (in vLLM's dtype).
        """
        st = self._esopt
        compared = differ = 0
        now = _live_parameters(self.model_runner.model)  # a reload may have swapped Parameter objects
        for n, t in st["tensors"].items():
            live = now[n]
            if tuple(live.shape) != tuple(t.shape):
                continue  # prepacked by vLLM on CPU: only its outputs can tell
            compared += 1
            differ += int((live.detach().to("cpu") != t.detach().to("cpu").to(live.dtype)).sum())
        return {"live_tensors_compared": compared, "live_elements_differ": differ}

    # ------------------------------------------------------------------ state (checkpoints, tests)
    def esopt_perturber(self):
        """The worker's Perturber (in-process executors: the object itself; checkpoints read its shards)."""
        return self._esopt_perturber

    def esopt_load_state(self, states) -> None:
        self._esopt_perturber.load_state_([s.to(t.device) for s, t in zip(states, self._esopt_perturber.state_tensors())])
        self._esopt_changed()

    def esopt_pieces(self, perturbed_only: bool = True) -> list[dict]:
        return [p.to_json() for p in self._esopt["chosen" if perturbed_only else "pieces"]]

    def esopt_runtime(self) -> dict[str, torch.Tensor]:
        """CPU copies of the runtime tensors as the worker holds them (live views or the reload copy)."""
        return {n: t.detach().to("cpu", copy=True) for n, t in self._esopt["tensors"].items()}
