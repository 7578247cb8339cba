"""Seed ledger, sharded safetensors checkpoints, exact resume, HF export.

The ledger ``history.jsonl`` holds, per step, everything the update used
(member seeds, signs, raw returns, shaped weights, sigma_t, alpha_t); an
update is a pure function of those, so base weights + ledger = the run's
weights. Checkpoints only shorten the replay: ``ckpt/step_<N>/tp<r>.safetensors``
holds each tp rank's local shards under their canonical names (the fp32
master when ``master=fp32_host``), written to a temporary directory and
renamed when every rank has written.
"""
from __future__ import annotations

import json
import logging
import os
import shutil

import torch.distributed as dist

log = logging.getLogger(__name__)
LEDGER = "history.jsonl"


class Ledger:
    def __init__(self, run_dir: str, config_hash: str, rank: int):
        self.path = os.path.join(run_dir, LEDGER)
        self.config_hash, self.rank = config_hash, rank

    def read(self) -> list[dict]:
        """Complete entries in order (a torn last line from a crash is ignored)."""
        if not os.path.exists(self.path):
            return []
        entries = []
        with open(self.path) as f:
            for line in f:
                try:
                    entries.append(json.loads(line))
                except json.JSONDecodeError:
                    break
        for e in entries:
            if e.get("config_hash") != self.config_hash:
                raise ValueError(
                    f"{self.path} was written by a different configuration (hash {e.get('config_hash')} != "
                    f"{self.config_hash}); use a new run.dir or the original config"
                )
        steps = [e["step"] for e in entries]
        if steps != list(range(len(steps))):
            raise ValueError(f"{self.path}: steps are not consecutive from 0: {steps[:10]}...")
        return entries

    def append(self, entry: dict) -> None:
        """Write + fsync on rank 0; a crash leaves at worst a torn last line, which :meth:`read` drops."""
        if self.rank != 0:
            return
        entry = dict(entry, config_hash=self.config_hash)
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def truncate_to(self, n: int) -> None:
        """Drop a torn tail so that appends continue a clean file (rank 0)."""
        if self.rank != 0 or not os.path.exists(self.path):
            return
        with open(self.path) as f:
            lines = f.readlines()
        if len(lines) != n:
            with open(self.path + ".tmp", "w") as f:
                f.writelines(lines[:n])
                f.flush()
                os.fsync(f.fileno())
            os.replace(self.path + ".tmp", self.path)


def _ckpt_root(run_dir: str) -> str:
    return os.path.join(run_dir, "ckpt")


def save_checkpoint(run_dir: str, step: int, perturber, dims) -> str | None:
    """Every rank of dp group 0 writes its shard; rank 0 renames the directory once all have."""
    from safetensors.torch import save_file

    root = _ckpt_root(run_dir)
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    if dims.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
    if dims.distributed:
        dist.barrier()
    if dims.dp_rank == 0:
        tensors, meta = {}, {}
        for shard, state in zip(perturber.shards, perturber.state_tensors()):
            tensors[shard.info.name] = state.detach().to("cpu").contiguous()
            meta[shard.info.name] = json.dumps({"global_shape": shard.info.global_shape, "offset": shard.info.offset})
        save_file(tensors, os.path.join(tmp, f"tp{dims.tp_rank}.safetensors"), metadata=meta)
    if dims.distributed:
        dist.barrier()
    if dims.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    if dims.distributed:
        dist.barrier()
    return final


def latest_checkpoint(run_dir: str, max_step: int) -> tuple[int, str] | None:
    root = _ckpt_root(run_dir)
    if not os.path.isdir(root):
        return None
    steps = sorted(int(d[5:]) for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))
    steps = [s for s in steps if s <= max_step]
    return (steps[-1], os.path.join(root, f"step_{steps[-1]:06d}")) if steps else None


def load_checkpoint_(path: str, perturber, dims) -> None:
    from safetensors import safe_open

    with safe_open(os.path.join(path, f"tp{dims.tp_rank}.safetensors"), "pt") as f:
        meta = f.metadata() or {}
        states = []
        for shard in perturber.shards:
            info = json.loads(meta[shard.info.name])
            if tuple(info["offset"]) != shard.info.offset or tuple(info["global_shape"]) != shard.info.global_shape:
                raise ValueError(f"{path}: {shard.info.name} was saved for another layout ({info})")
            states.append(f.get_tensor(shard.info.name))
    perturber.load_state_(states)


def replay_(perturber, entries: list[dict]) -> None:
    """Re-apply the ledger's updates (no rollouts): bit-identical to the original steps."""
    for e in entries:
        perturber.update(e["seeds"], e["signs"], e["weights"], e["alpha"], e.get("weight_decay", 0.0))


def restore_run_(run_dir: str, perturber, dims, entries: list[dict], use_checkpoint: bool = True) -> int:
    """Bring the weights to the end of ``entries``: newest checkpoint (if any, and wanted) + ledger replay.

    Returns the step the checkpoint covered (0 without one).
    """
    done = 0
    ckpt = latest_checkpoint(run_dir, len(entries)) if use_checkpoint else None
    if ckpt is not None:
        done, path = ckpt
        load_checkpoint_(path, perturber, dims)
    replay_(perturber, entries[done:])
    return done
