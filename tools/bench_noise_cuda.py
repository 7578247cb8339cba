"""The Triton noise kernels on CUDA: equality with the torch reference on the same GPU, and throughput.

Run through ``python tools/bench_noise.py --cuda [--check-only]``; prints one JSON object. Figures,
all from this one run:

- ``equal``: fused kernels vs the eager torch path on the same GPU, bit for bit (eps on whole / row /
  column / uneven / 3-d slices; perturb, restore, update with G = 1, 8, 32, fp32 and bf16 weights,
  with and without weight decay); ``cuda_vs_cpu_max_ulp``: eps on the GPU vs the CPU reference
  (fp64 libm differences may move a float32 by an ulp);
- ``noise_elems_per_s``: eps written to memory by the kernel;
- ``update_G*``: the fused update's weight bytes (read + write) per second, as a fraction of a
  device-to-device copy of the same bytes, and its time as a multiple of one perturb pass.
"""
from __future__ import annotations

import os

import torch

from esopt_mp.es import Perturber, local_noise, member_seed
from esopt_mp.es.shard import LocalShard, ShardInfo

SEED = (1 << 63) + 12345


def skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 is set: the kernels would run in the interpreter, not on the GPU"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton not importable: {e}"
    return None


def _boxes():
    name = "model.layers.0.mlp.down_proj.weight"
    yield "whole", ShardInfo.full(name, (257, 1031))
    yield "rows", ShardInfo(name, (256, 1031), (128, 0), (128, 1031))
    yield "cols", ShardInfo(name, (256, 1031), (0, 515), (256, 516))
    yield "uneven", ShardInfo(name, (256, 1031), (3, 7), (250, 333))
    yield "box3d", ShardInfo(name, (8, 33, 65), (1, 2, 3), (5, 30, 60))


def check(dev: torch.device) -> dict:
    equal, ulps = {}, {}
    for kind, info in _boxes():
        ref = local_noise(SEED, info, device=dev, backend="eager")
        equal[f"eps_{kind}"] = torch.equal(local_noise(SEED, info, device=dev, backend="triton"), ref)
        cpu = local_noise(SEED, info)
        ulps[kind] = int((ref.cpu().view(torch.int32).long() - cpu.view(torch.int32).long()).abs().max())
    infos = [info for _, info in _boxes()]
    for dtype in (torch.float32, torch.bfloat16):
        for g in (1, 8, 32):
            for master, restore, wd in (("none", "subtract", 0.0), ("none", "snapshot", 0.01),
                                        ("fp32_host", "snapshot", 0.01)):
                res = []
                for backend in ("eager", "triton"):
                    gen = torch.Generator().manual_seed(0)
                    ts = [(torch.randn(i.local_shape, generator=gen) * 0.05).to(dtype).to(dev) for i in infos]
                    p = Perturber([LocalShard(t, i) for t, i in zip(ts, infos)], restore=restore, master=master,
                                  noise_backend=backend, chunk_elems=1 << 16)
                    p.perturb(member_seed(1, 2, 3), 0.02, sign=-1)
                    out = [t.clone() for t in ts]
                    p.restore()
                    out += [t.clone() for t in ts]
                    seeds = [member_seed(5, 1, k) for k in range(g)]
                    p.update(seeds, [1, -1] * (g // 2) or [1], [0.5 - 0.03 * k for k in range(g)], 0.3, wd)
                    res.append(out + [t.clone() for t in ts])
                equal[f"{str(dtype)[6:]}_G{g}_{master}_{restore}_wd{wd}"] = all(
                    torch.equal(a, b) for a, b in zip(*res))
    return {"equal": equal, "cuda_vs_cpu_max_ulp": ulps}


def _time(fn, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, after one warm-up (compilation)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def bench(dev: torch.device, n: int, reps: int) -> dict:
    from esopt_mp.es import triton_noise

    info = ShardInfo.full("bench.weight", (n,))
    out = {"elements": n, "device": torch.cuda.get_device_name(dev)}
    buf = torch.empty(n, dtype=torch.float32, device=dev)
    t_noise = _time(lambda: triton_noise.axpy_(buf, SEED, info, None), reps)
    out["noise_elems_per_s"] = n / t_noise
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.zeros(n, dtype=dtype, device=dev)
        src = torch.zeros_like(w)
        nbytes = 2 * n * w.element_size()  # a copy, a perturb and an update each read and write every weight once
        t_copy = _time(lambda: w.copy_(src), reps)
        p = Perturber([LocalShard(w, info)], restore="subtract", noise_backend="triton")
        t_perturb = _time(lambda: triton_noise.axpy_(w, SEED, info, 1e-3), reps)
        d = {"copy_bytes_per_s": nbytes / t_copy, "perturb_s": t_perturb,
             "perturb_over_copy": (nbytes / t_perturb) / (nbytes / t_copy)}
        for g in (8, 32):
            seeds = [member_seed(0, 0, k) for k in range(g)]
            t = _time(lambda: p.update(seeds, [1] * g, [1.0] * g, 1e-3), max(1, reps // 2))
            d[f"update_G{g}"] = {"seconds": t, "bytes_per_s": nbytes / t, "fraction_of_copy": t_copy / t,
                                 "over_one_perturb": t / t_perturb, "noise_elems_per_s": n * g / t}
        out[str(dtype)[6:]] = d
    return out
