"""Noise / Perturber benchmark: prints one JSON object.

Figures (all measured in this one run, so ratios are meaningful on a noisy machine):
- noise throughput of the counter-based generator (eager and torch.compile) vs torch.randn and vs
  an fp32 copy of the same bytes;
- fused update throughput for G=8 and G=32 (parameter elements/s and noise elements/s);
- peak extra resident memory of perturb / restore / update on a >= 100M-parameter fp32
  model for each precision mode (subtract; snapshot; snapshot + fp32_host master), each mode
  in a fresh subprocess, against the shard size (the mode's state) and the chunk size (the
  op's transient); measured with VmHWM, reset before every op;
- drift of 1000 bf16 perturb/restore cycles with ``subtract`` (max / RMS ulp) vs ``snapshot``;
- how far 100 updates of 1e-5 move bf16 weights with and without the fp32 host master.

With ``--cuda``: the Triton kernels on a GPU instead (tools/bench_noise_cuda.py: equality with the torch
path on the same GPU, noise elements/s, the fused update's bytes/s as a fraction of a device-to-device
copy, G=8/32 update over one perturb pass); without CUDA it prints why it skipped and exits 0.

Usage: python tools/bench_noise.py [--quick] [--cuda [--check-only]]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from esopt_mp.profiling.record import print_record
from esopt_mp.es import Perturber, local_noise, member_seed
from esopt_mp.es.shard import LocalShard, ShardInfo
from esopt_mp.es.ulp import ulp_drift

MIB = 1 << 20


def _rate(fn, n_elems: int, repeat: int) -> float:
    fn()  # warm-up (and compile)
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return n_elems * repeat / (time.perf_counter() - t)


def bench_throughput(n: int, repeat: int) -> dict:
    info = ShardInfo.full("bench.weight", (n,))
    out = {"elements": n}
    out["randn_elems_per_s"] = _rate(lambda: torch.randn(n), n, repeat)
    src, dst = torch.randn(n), torch.empty(n)  # the memory-bandwidth floor: fp32 copy of the bytes the noise fills
    out["copy_elems_per_s"] = _rate(lambda: dst.copy_(src), n, repeat)
    out["eager_elems_per_s"] = _rate(lambda: local_noise(1, info, block=1 << 17), n, max(1, repeat // 4))
    out["compiled_elems_per_s"] = _rate(lambda: local_noise(1, info, block=1 << 17, backend="compile"), n, repeat)
    out["randn_over_compiled"] = out["randn_elems_per_s"] / out["compiled_elems_per_s"]
    out["randn_over_eager"] = out["randn_elems_per_s"] / out["eager_elems_per_s"]
    out["copy_over_compiled"] = out["copy_elems_per_s"] / out["compiled_elems_per_s"]
    return out


def bench_update(n: int, groups=(8, 32)) -> dict:
    w = torch.zeros(n)
    p = Perturber([LocalShard(w, ShardInfo.full("bench.weight", (n,)))], chunk_elems=1 << 22, noise_backend="compile")
    p.update([1], [1], [1.0], 1e-3)  # compile outside the timing
    res = {}
    for g in groups:
        seeds = [member_seed(0, 0, i) for i in range(g)]
        t = time.perf_counter()
        p.update(seeds, [1] * g, [1.0] * g, 1e-3)
        dt = time.perf_counter() - t
        res[f"G{g}"] = {"seconds": dt, "param_elems_per_s": n / dt, "noise_elems_per_s": n * g / dt}
    return res


# ---------------------------------------------------------------- memory (subprocess)
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


MEMORY_MODES = {"subtract": ("subtract", "none"), "snapshot": ("snapshot", "none"),
                "snapshot+fp32_host": ("snapshot", "fp32_host")}


def _op_figures(rss0: int, before: int, dt: float, shard: int, chunk_bytes: int) -> dict:
    """Peak and retained resident memory of one op, over the RSS before the Perturber existed."""
    peak, after = _status("VmHWM"), _status("VmRSS")
    return {"seconds": dt, "extra_bytes": peak - rss0, "extra_over_shard": (peak - rss0) / shard,
            "transient_bytes": peak - before, "transient_over_chunk": (peak - before) / chunk_bytes,
            "retained_bytes": after - rss0, "retained_over_shard": (after - rss0) / shard}


def _memory_child(mode: str, params_m: float, chunk: int, backend: str = "compile") -> dict:
    """One precision mode in a fresh process: Perturber construction, perturb, restore, update."""
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS") or os.environ.get("OMP_NUM_THREADS") or 2))
    restore, master = MEMORY_MODES[mode]
    hidden, vocab = (1024, 32000) if params_m >= 50 else (256, 4000) if params_m >= 1 else (128, 1000)
    ffn = hidden * 11 // 4
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    layer = 0
    while sum(a * b for a, b in shapes.values()) < params_m * 1_000_000:
        for name, shape in (("q_proj", (hidden, hidden)), ("k_proj", (hidden, hidden)), ("v_proj", (hidden, hidden)),
                            ("o_proj", (hidden, hidden)), ("gate_proj", (ffn, hidden)),
                            ("up_proj", (ffn, hidden)), ("down_proj", (hidden, ffn))):
            shapes[f"model.layers.{layer}.{name}.weight"] = shape
        layer += 1
    shards = []
    for name, shape in shapes.items():
        t = torch.empty(shape)
        t.normal_(0, 0.02)  # in place: no temporaries
        shards.append(LocalShard(t, ShardInfo.full(name, shape)))
    # compile the kernel (full and tail blocks of this chunk size) before measuring: compiling allocates
    warm = Perturber([LocalShard(torch.zeros(3 * chunk // 2 + 17), ShardInfo.full("warm", (3 * chunk // 2 + 17,)))],
                     chunk_elems=chunk, noise_backend=backend)
    warm.perturb(1, 1.0)
    warm.restore()
    warm.update([1, 2], [1, 1], [1.0, 1.0], 1.0)
    del warm
    n = sum(s.info.numel for s in shards)
    shard, chunk_bytes = sum(s.tensor.numel() * s.tensor.element_size() for s in shards), 4 * chunk
    seeds = [member_seed(0, 0, i) for i in range(8)]
    rss0 = _status("VmRSS")
    res = {"mode": mode, "restore_mode": restore, "master_mode": master, "params": n, "shard_bytes": shard,
           "chunk_bytes": chunk_bytes}
    ops = (("init", None), ("perturb", lambda p: p.perturb(seeds[0], 1e-3)), ("restore", lambda p: p.restore()),
           ("update", lambda p: p.update(seeds, [1] * 8, [1.0] * 8, 1e-3)))
    p = None
    for op, fn in ops:
        before = _status("VmRSS")
        _reset_peak()
        t = time.perf_counter()
        if fn is None:
            p = Perturber(shards, restore=restore, master=master, chunk_elems=chunk, noise_backend=backend)
        else:
            fn(p)
        res[op] = _op_figures(rss0, before, time.perf_counter() - t, shard, chunk_bytes)
    return res


def bench_memory(params_m: float, chunk: int, backend: str = "compile") -> dict:
    """Each mode in its own process so one mode's allocations cannot hide in another's peak (``backend``: the noise
    kernel there; --quick: eager, as three cold compiles would cost more than the smoke test measures)."""
    res = {}
    for mode in MEMORY_MODES:
        cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", mode, str(params_m), str(chunk), backend]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    first = res["subtract"]
    res.update(params=first["params"], shard_bytes=first["shard_bytes"], chunk_bytes=first["chunk_bytes"])
    return res


def bench_drift(n: int, cycles: int, backend: str = "compile") -> dict:
    torch.manual_seed(0)
    base = (torch.randn(n) * 0.02).bfloat16()
    info = ShardInfo.full("drift.weight", (n,))
    out = {"elements": n, "cycles": cycles, "sigma": 1e-3}
    for mode in ("subtract", "snapshot"):
        w = base.clone()
        p = Perturber([LocalShard(w, info)], restore=mode, noise_backend=backend)  # the same eps either way
        for i in range(cycles):
            p.perturb(member_seed(9, 0, i), 1e-3)
            p.restore()
        max_ulp, rms_ulp = ulp_drift(w, base)
        diff = (w.double() - base.double()).abs()
        out[mode] = {"max_ulp": max_ulp, "rms_ulp": rms_ulp, "max_abs": float(diff.max()),
                     "rms_abs": float(diff.pow(2).mean().sqrt()), "changed_fraction": float((w != base).double().mean())}
    # 100 updates of 1e-5 on bf16 weights, with and without the fp32 host master
    small = ((torch.rand(65536) * 2 - 1) * 0.02).bfloat16()
    sinfo = ShardInfo.full("small.weight", (65536,))
    expected = 100 * 1e-5 * local_noise(42, sinfo).double()
    for master in ("fp32_host", "none"):
        w = small.clone()
        p = Perturber([LocalShard(w, sinfo)], master=master)
        for _ in range(100):
            p.update([42], [1], [1.0], 1e-5)
        moved = (w.double() - small.double())
        out[f"moved_fraction_{master}"] = float((moved * expected).sum() / (expected * expected).sum())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog=os.environ.get("ESOPT_PROG"), description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--cuda", action="store_true", help="the Triton kernels on CUDA (skips cleanly without)")
    ap.add_argument("--check-only", action="store_true", help="with --cuda: only the equality checks")
    ap.add_argument("--memory-child", nargs=4, metavar=("MODE", "PARAMS_M", "CHUNK", "BACKEND"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        mode, params_m, chunk, backend = args.memory_child
        print(json.dumps(_memory_child(mode, float(params_m), int(chunk), backend)))
        return
    if args.cuda:
        import bench_noise_cuda as bc  # tools/ is on sys.path when this script runs

        reason = bc.skip_reason()
        if reason:
            print_record("noise", {"skipped": True, "reason": reason})
            return
        dev = torch.device("cuda")
        result = bc.check(dev)
        if not args.check_only:
            result["bench"] = bc.bench(dev, 1 << (22 if args.quick else 27), 3 if args.quick else 5)
        print_record("noise", result)
        return
    # BENCH_THREADS, else OMP_NUM_THREADS (a test suite sharing the cores sets it), else two
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS") or os.environ.get("OMP_NUM_THREADS") or 2))
    quick = args.quick
    backend = "eager" if quick else "compile"  # the throughput figure always compiles
    result = {
        "threads": torch.get_num_threads(),
        "throughput": bench_throughput(1 << (18 if quick else 24), 2 if quick else 5),
        "update": bench_update(1 << (16 if quick else 22)),
        "memory": bench_memory(0.25 if quick else 110, 1 << (16 if quick else 22), backend),
        "drift_bf16": bench_drift(1 << (12 if quick else 20), 50 if quick else 1000, backend),
    }
    print_record("noise", result)


if __name__ == "__main__":
    main()
