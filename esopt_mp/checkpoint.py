"""Sharded safetensors checkpoints with integrity manifests, elastic load, pruning; exact resume.

The ledger (:mod:`esopt_mp.ledger`) is the run's ground truth: base weights +
ledger = the run's weights. Checkpoints only shorten the replay.
``ckpt/step_<N>/tp<r>.safetensors`` holds tp rank r's local shards under their
canonical names (the fp32 master when ``master=fp32_host``), each with its
global shape and offset in the metadata. Every file is fsynced; rank 0 then
writes ``manifest.json`` (size and SHA-256 of every file) last, fsyncs the
directory and renames ``step_<N>.tmp`` to ``step_<N>``. A checkpoint counts only
with a manifest whose files match it, so a crash at any point of a save, or a
later truncation, falls back to the previous complete checkpoint (or to base +
full replay). Loading is elastic: each rank assembles its own box from the
intersecting saved boxes, whatever tp layout wrote them.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import shutil

import torch

from esopt_mp.identity import file_sha256
from esopt_mp.ledger import LEDGER, Ledger, LedgerError, fsync_dir

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
FORMAT = 1
__all__ = ["LEDGER", "Ledger", "LedgerError", "CheckpointError", "save_checkpoint",
           "checkpoint_steps", "load_checkpoint_", "prune_checkpoints", "replay_", "restore_run_"]


class CheckpointError(ValueError):
    """A checkpoint is incomplete, corrupt, or does not cover this rank's shards."""


def _ckpt_root(run_dir: str) -> str:
    return os.path.join(run_dir, "ckpt")


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_rank_file(tmp: str, tp_rank: int, perturber) -> None:
    """This tp rank's shards -> ``tmp/tp<r>.safetensors`` (fsynced) and a sidecar with its size and SHA-256."""
    from safetensors.torch import save_file

    tensors, meta = {}, {}
    for shard, state in zip(perturber.shards, perturber.state_tensors()):
        info = shard.info  # several boxes of one tensor (a fused vLLM runtime tensor) get keys name@offset
        key = info.name if info.name not in tensors else f"{info.name}@{','.join(map(str, info.offset))}"
        tensors[key] = state.detach().to("cpu").contiguous()
        meta[key] = json.dumps({"name": info.name, "global_shape": info.global_shape, "offset": info.offset})
    name = f"tp{tp_rank}.safetensors"
    path = os.path.join(tmp, name)
    save_file(tensors, path, metadata=meta)
    _fsync_file(path)
    _write_json(os.path.join(tmp, f"tp{tp_rank}.sum.json"),
                {"file": name, "bytes": os.path.getsize(path), "sha256": file_sha256(path)})


def finalize(tmp: str, final: str, step: int, tp: int) -> None:
    """Rank 0, after every rank wrote: manifest last, fsync, rename, fsync the parent."""
    files = {}
    for r in range(tp):
        side = os.path.join(tmp, f"tp{r}.sum.json")
        with open(side) as f:
            s = json.load(f)
        files[s["file"]] = {"bytes": s["bytes"], "sha256": s["sha256"]}
    _write_json(os.path.join(tmp, MANIFEST), {"format": FORMAT, "step": step, "tp": tp, "files": files})
    for r in range(tp):
        os.remove(os.path.join(tmp, f"tp{r}.sum.json"))
    fsync_dir(tmp)
    if os.path.exists(final):  # a re-save of this step: move the old one aside, drop it after the rename
        shutil.rmtree(final + ".old", ignore_errors=True)
        os.replace(final, final + ".old")
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(final))
    shutil.rmtree(final + ".old", ignore_errors=True)


def save_checkpoint(run_dir: str, step: int, perturber, dims, keep: int = 0) -> str:
    """Every rank of dp group 0 writes its shard; rank 0 finalizes, then keeps the newest ``keep`` (0: all)."""
    root = _ckpt_root(run_dir)
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    if dims.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
        fsync_dir(root)
    dims.comm.barrier()
    if dims.dp_rank == 0:
        write_rank_file(tmp, dims.tp_rank, perturber)
    dims.comm.barrier()
    if dims.rank == 0:
        finalize(tmp, final, step, dims.tp)
        prune_checkpoints(run_dir, keep, step)
    dims.comm.barrier()
    return final


def _dirs(run_dir: str) -> list[tuple[int, str, bool]]:
    """(step, path, is_leftover) of every checkpoint directory; ``step_N.tmp``/``.old`` are leftovers."""
    root = _ckpt_root(run_dir)
    out = []
    for d in os.listdir(root) if os.path.isdir(root) else []:
        stem, _, suffix = d.partition(".")
        if stem.startswith("step_") and stem[5:].isdigit():
            out.append((int(stem[5:]), os.path.join(root, d), bool(suffix)))
    return sorted(out)


def check_checkpoint(path: str, files: list[str] | None = None, digest: bool = False) -> dict:
    """The manifest of ``path`` after checking ``files`` (default all): sizes and headers, SHA-256 if ``digest``."""
    from safetensors import safe_open

    try:
        with open(os.path.join(path, MANIFEST)) as f:
            man = json.load(f)
        entries = man["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: no valid {MANIFEST} ({e}); the save did not complete") from None
    for name in entries if files is None else files:
        p, want = os.path.join(path, name), entries.get(name)
        if want is None or not os.path.isfile(p):
            raise CheckpointError(f"{path}: {name} is missing")
        if os.path.getsize(p) != want["bytes"]:
            raise CheckpointError(f"{path}: {name} has {os.path.getsize(p)} bytes, the manifest says {want['bytes']}")
        try:
            with safe_open(p, "pt") as f:
                f.metadata()
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: {name} has an unreadable header ({e})") from None
        if digest and file_sha256(p) != want["sha256"]:
            raise CheckpointError(f"{path}: {name} does not match its SHA-256 in the manifest")
    return man


def checkpoint_steps(run_dir: str, max_step: int | None = None) -> list[tuple[int, str]]:
    """Complete checkpoints (manifest present, sizes and headers check out), oldest first."""
    out = []
    for step, path, is_tmp in _dirs(run_dir):
        if is_tmp or (max_step is not None and step > max_step):
            continue
        try:
            check_checkpoint(path)
        except CheckpointError as e:
            log.warning("skipping checkpoint: %s", e)
            continue
        out.append((step, path))
    return out


def prune_checkpoints(run_dir: str, keep: int, newest: int) -> list[str]:
    """Rank 0 after saving step ``newest``: delete all but the newest ``keep`` complete checkpoints (0: keep all).

    Also removes leftovers: ``.tmp`` directories of interrupted saves and
    checkpoints past ``newest`` (from steps the ledger no longer holds). The
    checkpoint just saved is always kept.
    """
    removed = []
    complete = {s for s, _ in checkpoint_steps(run_dir, newest)}
    kept = set(sorted(complete)[-keep:]) if keep > 0 else complete
    kept.add(newest)
    for step, path, is_tmp in _dirs(run_dir):
        stale = is_tmp or step > newest
        if stale or (keep > 0 and step not in kept):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        fsync_dir(_ckpt_root(run_dir))
        log.info("pruned %d checkpoint director%s", len(removed), "y" if len(removed) == 1 else "ies")
    return removed


def saved_boxes(path: str, man: dict) -> dict[str, list[tuple[str, str, tuple, tuple, tuple]]]:
    """Canonical name -> [(file, key in it, global shape, offset, shape)] of every box a checkpoint holds."""
    from safetensors import safe_open

    saved: dict[str, list] = {}
    for fname in sorted(man["files"]):
        with safe_open(os.path.join(path, fname), "pt") as f:
            meta = f.metadata() or {}
            for key in f.keys():
                info = json.loads(meta[key])
                shape = tuple(f.get_slice(key).get_shape())
                saved.setdefault(info.get("name", key), []).append(
                    (fname, key, tuple(info["global_shape"]), tuple(info["offset"]), shape))
    return saved


def export_checkpoint(path: str, base: str, out_dir: str, dtype: torch.dtype) -> str:
    """A checkpoint (any layout, any engine) + its base model directory -> a plain HF directory.

    The base directory's files, keys and layout, with every tensor the
    checkpoint holds assembled from its boxes (one tensor at a time, cast to
    ``dtype``); tensors ES did not touch are copied from the base. This is how
    the vllm engine exports: canonical tensors, never vLLM's fused names.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    man = check_checkpoint(path, digest=True)
    saved = saved_boxes(path, man)
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    used, total = set(), 0
    with contextlib.ExitStack() as stack:
        ckpt = {f: stack.enter_context(safe_open(os.path.join(path, f), "pt")) for f in man["files"]}  # opened once
        for fname in sorted(os.listdir(base)):
            src = os.path.join(base, fname)
            if not fname.endswith(".safetensors"):
                if os.path.isfile(src):
                    shutil.copy2(src, os.path.join(tmp, fname))
                continue
            tensors = {}
            with safe_open(src, "pt") as f:
                for key in f.keys():
                    if key not in saved:  # untouched by ES: as the base has it
                        tensors[key] = f.get_tensor(key).contiguous()
                        continue
                    used.add(key)
                    gshape_base = tuple(f.get_slice(key).get_shape())  # the base's values are not needed
                    full = torch.full(gshape_base, float("nan"), dtype=torch.float32)
                    for cfile, ckey, gshape, off, shape in saved[key]:
                        if gshape != gshape_base:
                            raise CheckpointError(f"{path}: {key} saved with global shape {gshape}, base has "
                                                  f"{gshape_base}")
                        full[tuple(slice(o, o + n) for o, n in zip(off, shape))] = ckpt[cfile].get_tensor(ckey).float()
                    if torch.isnan(full).any():
                        raise CheckpointError(f"{path}: the saved boxes of {key} do not cover it")
                    tensors[key] = full.to(dtype).contiguous()  # ES tensors in the served dtype
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
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def _plan(path: str, man: dict, perturber) -> dict[str, list[tuple[int, str, tuple, tuple]]]:
    """Per saved file, the pieces this rank needs: (shard index, name, saved-relative box, target-relative box)."""
    from safetensors import safe_open

    saved = saved_boxes(path, man)
    plan: dict[str, list] = {}
    for k, shard in enumerate(perturber.shards):
        info = shard.info
        boxes = {}
        for fname, key, gshape, off, shape in saved.get(info.name, []):
            if gshape != info.global_shape:
                raise CheckpointError(f"{path}: {info.name} was saved with global shape {gshape}, the model has "
                                      f"{info.global_shape}")
            boxes.setdefault((off, shape), (fname, key))  # a replicated tensor is in every tp file: read it once
        if not boxes:
            raise CheckpointError(f"{path}: no tensor {info.name} (saved with other es.include/es.exclude?)")
        pieces, covered = [], 0
        for (off, shape), (fname, key) in boxes.items():
            lo = [max(o, t) for o, t in zip(off, info.offset)]
            hi = [min(o + n, t + m) for o, n, t, m in zip(off, shape, info.offset, info.local_shape)]
            if any(a >= b for a, b in zip(lo, hi)) and info.numel:
                continue
            pieces.append(((fname, key), tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, off)),
                           tuple(slice(a - t, b - t) for a, b, t in zip(lo, hi, info.offset)), lo, hi))
            covered += math.prod(b - a for a, b in zip(lo, hi))
        for p, q in itertools.combinations(pieces, 2):
            if all(max(a1, a2) < min(b1, b2) for a1, b1, a2, b2 in zip(p[3], p[4], q[3], q[4])):
                raise CheckpointError(f"{path}: saved boxes of {info.name} overlap without being equal")
        if covered != info.numel:
            raise CheckpointError(f"{path}: saved shards of {info.name} cover {covered} of this rank's "
                                  f"{info.numel} elements")
        for (fname, key), src, dst, _, _ in pieces:
            plan.setdefault(fname, []).append((k, key, src, dst))
    return plan


def load_checkpoint_(path: str, perturber, dims=None) -> None:
    """Load this rank's shards from a checkpoint saved at any tp layout (reads slices, never whole files).

    Every check (manifest, sizes, headers, coverage, SHA-256 of the files this
    rank reads) runs before any weight is written; failures raise
    :class:`CheckpointError` and leave the weights untouched.
    """
    from safetensors import safe_open

    man = check_checkpoint(path)
    plan = _plan(path, man, perturber)
    check_checkpoint(path, sorted(plan), digest=True)
    states = perturber.state_tensors()
    with torch.no_grad():
        for fname, pieces in plan.items():
            with safe_open(os.path.join(path, fname), "pt") as f:
                for k, name, src, dst in pieces:
                    states[k][dst].copy_(f.get_slice(name)[src] if src else f.get_tensor(name))
    perturber.load_state_(states)  # in place: copies the master back to the device, drops a stale snapshot


def replay_(perturber, entries: list[dict]) -> None:
    """Re-apply the ledger's updates (no rollouts): bit-identical to the original steps."""
    for e in entries:
        perturber.update(e["seeds"], e["signs"], e["weights"], e["alpha"], e.get("weight_decay", 0.0))


def restore_run_(run_dir: str, perturber, dims, entries: list[dict], use_checkpoint: bool = True) -> int:
    """Bring the weights to the end of ``entries``: newest loadable checkpoint (if wanted) + ledger replay.

    A checkpoint that fails its checks is skipped for the previous one; with
    none left the replay starts from the base weights. Restoring is local to
    each rank (no collective), so ranks may even fall back differently and
    still agree. Returns the step the checkpoint covered (0 without one).
    """
    done = 0
    for step, path in reversed(checkpoint_steps(run_dir, len(entries)) if use_checkpoint else []):
        try:
            load_checkpoint_(path, perturber, dims)
        except CheckpointError as e:
            log.warning("checkpoint of step %d not loaded, trying an older one: %s", step, e)
            continue
        done = step
        break
    replay_(perturber, entries[done:])
    return done
