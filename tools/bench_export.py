"""Peak host memory of an HF export against the model's size, at tp=1 and tp=2 (spawned gloo ranks).

    python tools/bench_export.py [--vocab 8192 --hidden 512 --layers 4 --shard-fraction 0.1]

Each rank loads the model in a fresh process, writes every weight once (as
ES's updates do: the weights become private memory, not mmap'd file pages
that merely get faulted in by reading), resets its RSS high-water mark
(``/proc/self/clear_refs``), exports, and reads the high-water mark back
(``VmHWM``): ``peak_extra`` is what the export added over the resident size
before it. Beside it, counted: ``gathered_unwritten_max_bytes``, the most bytes the
writer's tp gathers held before a file was written. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import tempfile

from esopt_mp.profiling.record import print_record


def _status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        s = f.read()
    return {k: int(re.search(rf"{k}:\s+(\d+) kB", s).group(1)) * 1024 for k in ("VmHWM", "VmRSS")}


def export_memory_worker(rank: int, world: int, path: str, out_dir: str, shard_fraction: float, result: str) -> None:
    """Load ``path`` at tp=``world``, export it, write this rank's memory figures to ``result.<rank>``."""
    import huggingface_hub  # noqa: F401  (imports are not the export's memory)
    import safetensors.torch  # noqa: F401
    import torch
    import transformers.modeling_utils  # noqa: F401

    from esopt_mp.models import export_hf, load_model
    from esopt_mp.parallel import ParallelDims, discover, init_distributed

    dims = init_distributed(discover(), 1, world) if world > 1 else ParallelDims(1, 1, 1)
    model = load_model(path, dims)
    with torch.no_grad():  # ES's updates make every weight private memory; untouched ones are mmap'd file pages
        for t in model.state_dict().values():
            (t.to_local() if hasattr(t, "to_local") else t).add_(0.0)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # global sizes, tied once
    shard = max(1, int(model_bytes * shard_fraction))
    # counted, beside the measured RSS: bytes the tp gathers produced since the last file was written (the writer
    # keeps them until its save_file; gathering the whole model first would show here as the model's size)
    from torch.distributed.tensor import DTensor

    gathered, full_tensor, save_file = [0, 0, False], DTensor.full_tensor, safetensors.torch.save_file

    def counted_full_tensor(self, *a, **k):
        t = full_tensor(self, *a, **k)
        gathered[0] += t.numel() * t.element_size()
        gathered[1] = max(gathered[1], gathered[0])
        return t

    def counted_save_file(*a, **k):
        gathered[0], gathered[2] = 0, True
        return save_file(*a, **k)

    DTensor.full_tensor, safetensors.torch.save_file = counted_full_tensor, counted_save_file
    gc.collect()
    before = _status()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    try:
        export_hf(model, None, out_dir, dims, max_shard_bytes=shard)
    finally:
        DTensor.full_tensor, safetensors.torch.save_file = full_tensor, save_file
    peak = _status()["VmHWM"]
    with open(f"{result}.{rank}", "w") as f:
        json.dump({"model_bytes": model_bytes, "max_shard_bytes": shard, "rss_before": before, "peak_rss": peak,
                   "peak_extra": peak - before, "peak_extra_over_model": round((peak - before) / model_bytes, 4),
                   "gathered_unwritten_max_bytes": gathered[1] if gathered[2] else None}, f)  # writer only


def measure(path: str, tmp: str, tp: int, shard_fraction: float) -> dict:
    from esopt_mp.parallel.local_world import run_world

    out = os.path.join(tmp, f"export_tp{tp}")
    res = os.path.join(tmp, f"mem_tp{tp}")
    run_world(tp, export_memory_worker, path, out, shard_fraction, res)
    ranks = {}
    for r in range(tp):
        with open(f"{res}.{r}") as f:
            ranks[f"rank{r}"] = json.load(f)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    return {"files": len(files), "ranks": ranks, "export": out}


def main() -> None:
    ap = argparse.ArgumentParser(prog=os.environ.get("ESOPT_PROG"), description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shard-fraction", type=float, default=0.1)
    args = ap.parse_args()
    from esopt_mp.models import build_tiny_qwen35

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_qwen35(os.path.join(tmp, "model"), arch="qwen3", vocab_size=args.vocab,
                                 hidden_size=args.hidden, num_hidden_layers=args.layers,
                                 intermediate_size=3 * args.hidden, num_attention_heads=8, num_key_value_heads=4,
                                 head_dim=args.hidden // 8)
        result = {"shard_fraction": args.shard_fraction}
        for tp in (1, 2):
            r = measure(path, tmp, tp, args.shard_fraction)
            r.pop("export")
            result[f"tp{tp}"] = r
    print_record("export", result)


if __name__ == "__main__":
    main()
