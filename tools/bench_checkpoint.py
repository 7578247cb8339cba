"""What a checkpoint costs the training step: synchronous save vs the asynchronous save's stall, in one run.

    python tools/bench_checkpoint.py [--mib 512] [--tensors 16] [--repeats 3]

One process (dp = tp = 1), a Perturber over ``--tensors`` fp32 tensors of
``--mib`` MiB in all. Reports (one JSON object): the synchronous save (write,
fsync, SHA-256, finalize), the time ``Checkpointer.save`` blocks the caller
when asynchronous (the host copy), the background write, and a resume's load
-- medians over ``--repeats``, with the ratios that matter:
``stall_over_sync`` (what the step still pays) and ``load_over_sync``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from esopt_mp.profiling.record import print_record


def main() -> None:
    ap = argparse.ArgumentParser(prog=os.environ.get("ESOPT_PROG"), description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    if args.mib < 1 or args.tensors < 1 or args.repeats < 1:
        ap.error("--mib, --tensors and --repeats must be >= 1")
    import torch

    from esopt_mp.checkpoint import Checkpointer, save_checkpoint
    from esopt_mp.resume import load_checkpoint_
    from esopt_mp.es import Perturber
    from esopt_mp.es.shard import LocalShard, ShardInfo
    from esopt_mp.parallel import ParallelDims

    torch.set_num_threads(1)
    n = args.mib * (1 << 20) // 4 // args.tensors
    rows = max(1, n // 1024)
    shards = [LocalShard(torch.randn(rows, 1024), ShardInfo.full(f"layer{i}.weight", (rows, 1024)))
              for i in range(args.tensors)]
    p, dims = Perturber(shards), ParallelDims(1, 1, 1)
    root = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
    sync, stall, write, load = [], [], [], []
    try:
        for r in range(args.repeats):
            t0 = time.perf_counter()
            save_checkpoint(os.path.join(root, "sync"), r + 1, p, dims, keep=1)
            sync.append(time.perf_counter() - t0)
            ck = Checkpointer(os.path.join(root, "async"), dims, keep=1, async_save=True)
            t0 = time.perf_counter()
            ck.save(r + 1, p)
            stall.append(time.perf_counter() - t0)
            path = ck.wait()
            write.append(time.perf_counter() - t0)
            ck.close()
            t0 = time.perf_counter()
            load_checkpoint_(path, p, dims)
            load.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in (("sync_save_s", sync), ("async_stall_s", stall),
                                                 ("async_total_s", write), ("load_s", load))}
    print_record("checkpoint", {"mib": args.mib, "tensors": args.tensors, "repeats": args.repeats,
                                **{k: round(v, 4) for k, v in med.items()},
                                "stall_over_sync": round(med["async_stall_s"] / med["sync_save_s"], 4),
                                "load_over_sync": round(med["load_s"] / med["sync_save_s"], 4),
                                "write_mib_per_s": round(args.mib / med["sync_save_s"], 1)})


if __name__ == "__main__":
    main()
