"""Run bodies for test_tied_export (importable by spawned children)."""
from __future__ import annotations

import json
import os

import torch

from esopt_mp.config import build_config
from esopt_mp.es import local_noise
from esopt_mp.runner import Stop, run
from esopt_mp.trainer import ESTrainer

IDS = torch.arange(1, 13).view(2, 6)


def run_cfg(model_path: str, run_dir: str, tp: int = 1):
    return build_config({
        "run": {"dir": run_dir, "checkpoint_every": 1, "export": True, "seed": 11},
        "model": {"path": model_path},
        "parallel": {"dp": 1, "tp": tp, "checksum_every": 0},
        "es": {"population": 4, "steps": 3, "mirrored": True, "restore": "snapshot",
               "sigma": {"kind": "constant", "start": 0.05, "end": 0.05},
               "alpha": {"kind": "constant", "start": 0.05, "end": 0.05}},
        "objective": {"name": "seed_hash"},
    }, tp)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def tied_perturbation(trainer) -> dict:
    """Shard names are unique; a tied embedding is one shard, and perturbing it perturbs lm_head by the same eps."""
    model, shards = trainer.model, trainer.shards
    names = [s.info.name for s in shards]
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    emb_shard, head_shard = (next(s for s in shards if s.tensor.data_ptr() == _local(w).data_ptr())
                             for w in (emb, head))
    before = _local(head).clone()
    seed, sigma = 12345, 0.1
    trainer.perturber.perturb(seed, sigma, 1)
    moved = _local(head) - before
    expected = sigma * local_noise(seed, head_shard.info)  # its own shard's eps: the embedding's when tied
    out = {"unique": len(names) == len(set(names)), "tied_object": emb is head,
           "head_is_emb_shard": head_shard is emb_shard, "moved": bool(moved.abs().max() > 0),
           "head_moved_by_eps": bool(torch.allclose(moved, expected, atol=1e-6)),
           "lm_head_shard": "lm_head.weight" in names, "emb_name": emb_shard.info.name}
    trainer.perturber.restore()
    out["restored"] = bool(torch.equal(_local(head), before))
    return out


def train_interrupted_then_resumed(model_path: str, run_dir: str, tp: int, dims) -> dict:
    """Stop after step 1 (checkpoint), then a fresh trainer resumes and finishes; returns what the test checks."""
    cfg = run_cfg(model_path, run_dir, tp)
    trainer = ESTrainer(cfg, dims)
    tied = tied_perturbation(trainer)
    stop, step = Stop(), trainer.step

    def stepping(t):  # the stop requested during the first step, as a signal would
        out = step(t)
        stop.requested = True
        return out

    trainer.step = stepping
    stopped = run(trainer, stop)
    trainer.close()
    trainer = ESTrainer(cfg, dims)
    start = trainer.start_step
    run(trainer)
    with torch.no_grad():
        logits = trainer.model(input_ids=IDS).logits
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    trainer.close()
    return {"stopped": stopped, "start": start, "tied": tied, "logits": logits.tolist()}


def tp2_worker(rank: int, world: int, variants: dict, root: str) -> None:
    from esopt_mp.parallel import discover, init_distributed

    dims = init_distributed(discover(), 1, 2)
    results = {}
    for name, path in variants.items():
        results[name] = train_interrupted_then_resumed(path, os.path.join(root, name), 2, dims)
    if rank == 0:
        with open(os.path.join(root, "results.json"), "w") as f:
            json.dump(results, f)
