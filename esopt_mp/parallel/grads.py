"""Gradient collectives for the policy-gradient baselines (GRPO/PPO); ES itself never sends gradients.

Data parallelism as DDP does it, without wrapping the model: after the local
backward, every dp group's gradients are averaged with one all-reduce per
bucket (the same bytes DDP moves, unoverlapped). With tensor parallelism a
sharded gradient's norm needs the squares of every tp shard; a replicated one
is counted once.
"""
from __future__ import annotations

import torch

from esopt_mp.parallel.dims import ParallelDims


def average_grads(grads: list[torch.Tensor], dims: ParallelDims, bucket_elems: int = 1 << 24) -> None:
    """Replace each local gradient by its mean over the dp group, in place (fp32 buckets)."""
    if dims.dp == 1 or not grads:
        return
    bucket: list[torch.Tensor] = []
    size = 0

    def flush():
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1).float() for g in bucket])
        flat = dims.comm.all_reduce(flat, "sum", "dp") / dims.dp
        k = 0
        for g in bucket:
            g.copy_(flat[k : k + g.numel()].view_as(g))
            k += g.numel()
        bucket.clear()

    for g in grads:
        if size + g.numel() > bucket_elems:
            flush()
            size = 0
        bucket.append(g)
        size += g.numel()
    flush()


def global_grad_norm(sharded: list[torch.Tensor], replicated: list[torch.Tensor], dims: ParallelDims) -> float:
    """L2 norm of the full gradient: tp shards' squares summed over the tp group, replicated ones once."""
    dev = (sharded or replicated)[0].device if (sharded or replicated) else torch.device("cpu")
    sq_shard = sum((g.float().pow(2).sum() for g in sharded), torch.zeros((), device=dev, dtype=torch.float64))
    sq_rep = sum((g.float().pow(2).sum() for g in replicated), torch.zeros((), device=dev, dtype=torch.float64))
    if dims.tp > 1:
        sq_shard = dims.comm.all_reduce(sq_shard.double().reshape(1), "sum", "tp")[0]
    return float(torch.sqrt(sq_shard + sq_rep))
