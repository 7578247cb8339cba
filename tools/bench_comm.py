"""Bytes communicated per ES step vs a gradient all-reduce of the same model: one JSON object.

- measured: a tiny Qwen3.5 model, 3 ES steps in spawned gloo worlds (dp x tp = 2x2 and 4x1),
  bytes counted by the collectives themselves (CommStats);
- accounted: Qwen3.5-27B built on the meta device, ES bytes from the same accounting
  (one all-gather of G x (return, flag) float64 + the replica checksum every k steps),
  against a ring all-reduce of fp32 / bf16 gradients of each rank's shard.

Usage: python tools/bench_comm.py
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from esopt_mp.parallel import CommStats  # noqa: E402

STEPS, G = 3, 8


def _worker(rank, world, dp, tp, model_path, run_dir, out):
    from esopt_mp.config import build_config
    from esopt_mp.parallel import discover, init_distributed
    from esopt_mp.trainer import ESTrainer

    cfg = build_config({"run": {"dir": run_dir}, "model": {"path": model_path},
                        "parallel": {"dp": dp, "tp": tp, "checksum_every": 1},
                        "es": {"population": G, "steps": STEPS}, "objective": {"batch": 2}}, world)
    trainer = ESTrainer(cfg, init_distributed(discover(), dp, tp))
    for t in range(STEPS):
        trainer.step(t)
    if rank == 0:
        torch.save({"bytes_per_step": trainer.comm.total / STEPS, "params": sum(
            s.info.numel for s in trainer.shards), "tensors": len(trainer.shards)}, out)


def allreduce_bytes(local_params: int, dp: int, elem_bytes: int) -> float:
    """Sent + received by one rank in a ring all-reduce over dp ranks."""
    return 4 * (dp - 1) / dp * local_params * elem_bytes


def es_bytes(dp: int, tp: int, n_tensors_local: int, checksum_every: int) -> float:
    stats = CommStats()
    stats.add_all_gather(G * 2 * 8, dp * tp)
    per_step = stats.total
    if checksum_every and dp > 1:
        chk = CommStats()
        chk.add_all_gather(n_tensors_local * 8, dp)
        per_step += chk.total / checksum_every
    return per_step


def main() -> None:
    from esopt_mp.models import build_meta_model, build_tiny_qwen35
    from esopt_mp.parallel.spawn import run_world

    result = {"population": G, "measured_tiny": {}, "qwen35_27b": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_qwen35(os.path.join(tmp, "tiny"))
        for dp, tp in ((2, 2), (4, 1)):
            out = os.path.join(tmp, f"out{dp}{tp}.pt")
            run_world(dp * tp, _worker, dp, tp, path, os.path.join(tmp, f"run{dp}{tp}"), out)
            r = torch.load(out)
            r.update(grad_allreduce_fp32=allreduce_bytes(r["params"], dp, 4),
                     grad_allreduce_bf16=allreduce_bytes(r["params"], dp, 2),
                     accounted_es_bytes=es_bytes(dp, tp, r["tensors"], 1))
            r["fp32_allreduce_over_es"] = r["grad_allreduce_fp32"] / r["bytes_per_step"]
            result["measured_tiny"][f"dp{dp}_tp{tp}"] = r
    model = build_meta_model("27b")
    params = sum(p.numel() for p in model.parameters())
    tensors = sum(1 for _ in model.parameters())
    result["qwen35_27b"]["params"] = params
    for dp, tp in ((2, 2), (4, 8), (16, 8)):
        local = params // tp
        es = es_bytes(dp, tp, tensors, checksum_every=10)
        result["qwen35_27b"][f"dp{dp}_tp{tp}"] = {
            "es_bytes_per_step": es, "grad_allreduce_fp32": allreduce_bytes(local, dp, 4),
            "grad_allreduce_bf16": allreduce_bytes(local, dp, 2),
            "bf16_allreduce_over_es": allreduce_bytes(local, dp, 2) / es,
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
