"""Memory profiles of inference, one ES step per precision mode, and one GRPO / PPO update, side by side.

Every profile uses the same model (a Qwen3.5 shape with random bf16 weights,
loaded through esopt_mp.models.load_model as training loads it, sharded at
tp > 1), the same fixed workload (batch, turns, prompts, new tokens: see
esopt_mp/profiling/workload.py) and runs in a fresh process per profile and
rank, so no peak leaks from one profile into the next. Prints one JSON object
(also written to OUT/memprof.json; its "versions" say what produced the figures:
Python, the platform, torch, transformers, Triton, vLLM, the driver) and writes
OUT/memprof_bars.png and OUT/memprof_timeline.png.

ES chunk: the update streams the weights in chunks of --chunk-elems (default: the trainer's
es.chunk_elems, 2^24) with one fp32 accumulator and applies the sum block by block, so the update
phase holds the weights plus ~chunk_elems x 4 bytes; it runs after the rollouts, so an ES step's peak
is max(rollouts, update), not their sum. (Before the blockwise apply, the in-place mixed-dtype add on
bf16 weights held two more fp32 chunk temporaries: measured 1.12x inference at the 0.46 B shape.)

Usage:
  python tools/memprof.py --shape 0.4b --profiles inference es_subtract es_snapshot es_snapshot_fp32_host
  torchrun --nproc_per_node 2 tools/memprof.py --shape 0.4b --tp 2
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import time

from esopt_mp.profiling.profiles import BASELINES, ES_MODES, PROFILES, ProfileOptions
from esopt_mp.profiling.versions import library_versions
from esopt_mp.profiling.workload import Workload

CPU_METHOD = ("CPU (no device): figures per rank. host_peak_bytes = peak resident set (psutil RSS sampled every "
              "{ms} ms, max'ed with the kernel's VmHWM reset at each phase mark) from model loaded to step end, "
              "{trim}; "
              "baseline_bytes = RSS after imports and process-group setup, before the model exists; "
              "device_peak_bytes (device-equivalent) = host peak above baseline minus host_by_design_bytes "
              "(Perturber.host_bytes: the snapshot / fp32 master, which live on the host by design); "
              "ru_maxrss_bytes = getrusage's high-water mark, a cross-check only: Linux resets it with VmHWM at each "
              "phase mark, so it can read below the sampled peak")
GPU_METHOD = ("GPU: device_peak_bytes = peak of {counter} sampled every {ms} ms from model loaded to step end "
              "(nvml_process: this process's usedGpuMemory; nvml_device: the whole device's used memory; torch: "
              "max_memory_reserved); torch_max_allocated/reserved_bytes beside it; host figures from RSS as on CPU "
              "({trim}); host_by_design_bytes (snapshot / fp32 master) live in host RAM and are not in the device "
              "figure")
COMMON = ("Same weights, batch, prompts and generated tokens in every profile (bf16, EOS ignored, KV and recurrent "
          "state grow with the context as the HF engine keeps them; no preallocated KV pool); one fresh process per "
          "profile and rank; ES: {pop} members (mirrored), chunk_elems {chunk}; grpo/ppo: one update of "
          "esopt_mp.baselines on the same rollouts")


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.4b", help="tiny | 0.4b | 4b | 9b | 27b")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (launch with torchrun, one per rank)")
    ap.add_argument("--out", default="memprof_out")
    ap.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=PROFILES)
    for k, v in dataclasses.asdict(Workload()).items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    ap.add_argument("--population", type=int, default=ProfileOptions.population)
    ap.add_argument("--chunk-elems", type=int, default=ProfileOptions.chunk_elems, help="ES es.chunk_elems")
    ap.add_argument("--grad-checkpointing", action="store_true")
    ap.add_argument("--no-malloc-trim", dest="malloc_trim", action="store_false",
                    help="keep glibc's freed heap in RSS across phase marks (default: malloc_trim(0) at each mark)")
    ap.add_argument("--interval-ms", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (memory does not "
                    "depend on it; more threads than free cores made a bf16 decode 40x slower on a shared CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-checkpoint", action="store_true", help="keep OUT/.ckpt-SHAPE for the next run")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="per profile")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one profile in this process
    ap.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)  # internal: write the checkpoint
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--raw", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _workload(a) -> Workload:
    return Workload(**{k: getattr(a, k) for k in dataclasses.asdict(Workload())})


def _options(a) -> ProfileOptions:
    if a.population < 1:
        raise ValueError(f"--population must be >= 1, got {a.population}")
    if a.chunk_elems < 1024:
        raise ValueError(f"--chunk-elems must be >= 1024, got {a.chunk_elems}")
    return ProfileOptions(population=a.population, chunk_elems=a.chunk_elems,
                          grad_checkpointing=a.grad_checkpointing, seed=a.seed, malloc_trim=a.malloc_trim)


def _fail(msg: str) -> int:
    print(f"memprof: {msg}", file=sys.stderr)
    return 2


def _cuda_free() -> int | None:
    """Free memory of this rank's GPU (NVML: no CUDA context in this parent process), None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(local)).free)
    except Exception:  # noqa: BLE001 - no NVML: torch's figure (creates a context here)
        return int(torch.cuda.mem_get_info(local)[0])


def _spawn(cmd: list[str], env: dict, timeout: float) -> tuple[int, str]:
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return p.returncode, p.stdout


def _wait_for(path: str, timeout: float) -> bool:
    t = time.time()
    while not os.path.exists(path):
        if time.time() - t > timeout:
            return False
        time.sleep(0.5)
    return True


def _aggregate(raws: list[dict], cpu: bool) -> dict:
    """Per-rank maxima over ranks, and the device(-equivalent) figure with its counter."""
    def mx(f):
        return max(f(r) for r in raws)

    d = {"baseline_bytes": mx(lambda r: r["baseline_bytes"]),
         "host_peak_bytes": mx(lambda r: r["window"]["host_peak_bytes"]),
         "host_peak_above_baseline_bytes": mx(lambda r: r["window"]["host_peak_bytes"] - r["baseline_bytes"]),
         "host_by_design_bytes": mx(lambda r: r["host_by_design_bytes"]),
         "ru_maxrss_bytes": mx(lambda r: r["ru_maxrss_bytes"])}
    if cpu:
        d["device_peak_bytes"] = mx(lambda r: r["window"]["host_peak_bytes"] - r["baseline_bytes"]
                                    - r["host_by_design_bytes"])
        d["method"] = "cpu device-equivalent: RSS peak - baseline - host_by_design (max over ranks)"
    else:
        counter = raws[0]["device_counter"]
        key = "device_peak_bytes" if counter.startswith("nvml") else "torch_max_reserved_bytes"
        d["device_peak_bytes"] = mx(lambda r: r["window"].get(key, 0))
        for k in ("torch_max_allocated_bytes", "torch_max_reserved_bytes"):
            d[k] = mx(lambda r: r["window"].get(k, 0))
        d["method"] = f"gpu: {counter} peak (max over ranks)"
    top = max(raws, key=lambda r: r["window"]["host_peak_bytes"] - r["baseline_bytes"])  # the rank with the peak
    d["phases"] = dict(top["phases"])
    d["phases_rank"] = top["rank"]
    d["decode_tokens"] = raws[0]["decode_tokens"]
    d["step_s"] = round(mx(lambda r: r["step_s"]), 2)
    d["per_rank"] = [{k: r[k] for k in ("rank", "baseline_bytes", "host_by_design_bytes", "local_params")}
                     | {"window": r["window"]} for r in raws]
    return d


def _ratio(profiles, a, b):
    if a in profiles and b in profiles and profiles[b]["device_peak_bytes"] > 0:
        return round(profiles[a]["device_peak_bytes"] / profiles[b]["device_peak_bytes"], 4)
    return None


def _predictions(config, profiles: dict, tp: int, wl: Workload, cpu: bool, opt: ProfileOptions) -> dict:
    try:
        from esopt_mp.profiling.memmodel import predict
    except ImportError:
        return {}
    out = {}
    for name, m in profiles.items():
        restore, master = ES_MODES.get(name, ("subtract", "none"))
        algo = "es" if name in ES_MODES else name
        p = predict(config, algo=algo, tp=tp, batch=wl.batch, context=wl.context, new_tokens=wl.new_tokens,
                    restore=restore, master=master, chunk_elems=opt.chunk_elems,
                    grad_checkpointing=opt.grad_checkpointing, device="cpu" if cpu else "cuda")
        dev, host = int(p.device_total), int(p.host_total)
        out[name] = {"device_bytes": dev, "host_bytes": host,
                     "rel_err_device": round((dev - m["device_peak_bytes"]) / max(1, m["device_peak_bytes"]), 4),
                     "rel_err_host": (round((host - m["host_by_design_bytes"]) / m["host_by_design_bytes"], 4)
                                      if m["host_by_design_bytes"] else None),
                     "device": p.device, "host": p.host}
    return out


def worker(a) -> int:
    from esopt_mp.parallel import close_distributed, exit_keeping_groups
    from esopt_mp.profiling.profiles import run_profile

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(max(1, a.threads))
    res = run_profile(a.worker, a.ckpt, a.tp, _workload(a), _options(a), a.interval_ms / 1000)
    tmp = a.raw + ".tmp"
    with open(tmp, "w") as f:  # a failed write raises before the barrier: the peers are not waited for
        json.dump(res, f)
    os.replace(tmp, a.raw)
    # written first; then, on gloo, the groups are left to the process's end (gloo may abort a rank tearing them
    # down even after every rank has met: the profile would read as failed)
    try:
        kept = close_distributed(drain=True, keep=_gloo())
    except Exception as e:  # noqa: BLE001 - a peer that failed: this rank's profile is written all the same
        logging.getLogger("memprof").warning("the other ranks could not be met after the profile (%s: %s)",
                                             type(e).__name__, e)
        kept = True
    if kept:
        exit_keeping_groups(0)
    return 0


def _gloo() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend() == "gloo"


def main(argv=None) -> int:
    a = _args(argv)
    if a.worker:
        return worker(a)
    import psutil

    from esopt_mp.parallel import discover
    from esopt_mp.profiling.fit import check_fits
    from esopt_mp.profiling.shapes import SHAPES, param_count, shape_config, write_random_checkpoint

    if a.prepare:
        write_random_checkpoint(a.shape, a.ckpt, a.seed)
        return 0
    if a.shape not in SHAPES:
        return _fail(f"--shape must be one of {list(SHAPES)}, got {a.shape!r}")
    try:
        wl, opt = _workload(a), _options(a)
    except ValueError as e:
        return _fail(str(e))
    le = discover()
    if a.tp < 1 or le.world_size != a.tp:
        return _fail(f"--tp {a.tp} needs exactly {a.tp} ranks, this launch has {le.world_size}: "
                     f"torchrun --nproc_per_node {a.tp} tools/memprof.py --tp {a.tp} ...")
    profiles = list(dict.fromkeys(a.profiles))
    if any(p in BASELINES for p in profiles):
        from esopt_mp.profiling.profiles import baselines_api

        try:
            baselines_api()
        except RuntimeError as e:
            return _fail(str(e))
    config = shape_config(a.shape)
    params = param_count(config)  # meta device: nothing allocated
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", le.world_size))
    cuda_free = _cuda_free()
    msg = check_fits(a.shape, config, params, profiles, a.tp, local_ranks, wl, cuda_free=cuda_free,
                     host_available=psutil.virtual_memory().available)
    if msg:
        return _fail(msg)
    os.makedirs(os.path.join(a.out, "raw"), exist_ok=True)
    ckpt = os.path.abspath(os.path.join(a.out, f".ckpt-{a.shape}"))
    me = [sys.executable, os.path.abspath(__file__)]
    shared = ["--shape", a.shape, "--tp", str(a.tp), "--ckpt", ckpt, "--seed", str(a.seed)]
    if le.rank == 0:
        rc, log = _spawn(me + shared + ["--prepare"], dict(os.environ), a.timeout_s)
        if rc:
            return _fail(f"writing the random checkpoint failed:\n{log[-3000:]}")
    elif not _wait_for(os.path.join(ckpt, "config.json"), a.timeout_s):
        return _fail(f"rank {le.rank}: no checkpoint at {ckpt} after {a.timeout_s} s")
    flags = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in dataclasses.asdict(wl)]
    flags += [f"--population={a.population}", f"--chunk-elems={a.chunk_elems}", f"--interval-ms={a.interval_ms}",
              f"--threads={a.threads}"]
    flags += ["--grad-checkpointing"] if a.grad_checkpointing else []
    flags += [] if a.malloc_trim else ["--no-malloc-trim"]
    errors = {}
    for i, name in enumerate(profiles):
        raw = os.path.join(a.out, "raw", f"{name}.rank{le.rank}.json")
        if os.path.exists(raw):
            os.remove(raw)
        env = dict(os.environ)
        if le.world_size > 1:  # a process group of its own per profile, with its own store (not torchrun's agent's)
            env.update(MASTER_PORT=str(le.master_port + 1 + i), TORCHELASTIC_USE_AGENT_STORE="False")
        rc, log = _spawn(me + shared + flags + ["--worker", name, "--raw", raw], env, a.timeout_s)
        if rc and os.path.exists(raw):  # written before its teardown: the profile stands
            print(f"memprof: profile {name} on rank {le.rank} exited {rc} after writing its result", file=sys.stderr)
        elif rc:
            errors[name] = log[-2000:]
            print(f"memprof: profile {name} failed on rank {le.rank} (exit {rc}):\n{log[-2000:]}", file=sys.stderr)
    if le.rank != 0:
        return 1 if errors else 0
    raws, profs = {}, {}
    cpu = cuda_free is None
    for name in profiles:
        files = [os.path.join(a.out, "raw", f"{name}.rank{r}.json") for r in range(le.world_size)]
        if name in errors or not all(_wait_for(f, 120) for f in files):
            continue
        rs = []
        for f in files:
            with open(f) as fh:
                rs.append(json.load(fh))
        raws[name] = rs[0]
        profs[name] = _aggregate(rs, cpu)
    if not a.keep_checkpoint:
        shutil.rmtree(ckpt, ignore_errors=True)
    counter = next(iter(raws.values()))["device_counter"] if raws else None
    nvml = any(r["nvml"] for r in raws.values())
    if not nvml:  # the profiles log it in their own processes; the user reads this one
        print("memprof: NVML unavailable (no GPU or no nvidia-ml-py): device memory not measured; "
              "host memory only (CPU device-equivalent, see 'method')", file=sys.stderr)
    trim = ("glibc's free heap returned to the kernel (malloc_trim) at the baseline and at each phase mark, so a "
            "phase starts from live memory" if a.malloc_trim else "no malloc_trim at the marks (--no-malloc-trim): "
            "RSS keeps the heap glibc retained from earlier phases")
    method = (CPU_METHOD if cpu else GPU_METHOD).format(ms=a.interval_ms, counter=counter, trim=trim) + ". " + \
        COMMON.format(pop=opt.population, chunk=opt.chunk_elems)
    report = {
        "model": {"params": params, "shape": a.shape, "config": {k: v for k, v in config.to_dict().items()
                                                                if k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                                         "intermediate_size", "head_dim",
                                                                         "num_attention_heads", "num_key_value_heads",
                                                                         "linear_num_key_heads",
                                                                         "linear_num_value_heads", "layer_types",
                                                                         "tie_word_embeddings")},
                  "dtype": "bfloat16", "tp": a.tp},
        "workload": wl.to_dict(), "method": method, "malloc_trim": a.malloc_trim, "nvml": nvml,
        "device": "cpu" if cpu else "cuda",
        "versions": library_versions(),  # what produced these figures: python, platform, torch, transformers...
        "profiles": profs,
        "ratios": {"es_over_inference": _ratio(profs, "es_subtract", "inference"),
                   "grpo_over_es": _ratio(profs, "grpo", "es_subtract"),
                   "ppo_over_es": _ratio(profs, "ppo", "es_subtract")},
        "prediction": _predictions(config, profs, a.tp, wl, cpu, opt),
        "errors": {k: v.strip().splitlines()[-1] if v.strip() else "failed" for k, v in errors.items()},
    }
    if not report["prediction"]:
        report["prediction_note"] = "esopt_mp.profiling.memmodel is not in this checkout"
    if profs:
        from esopt_mp.profiling.plots import bar_chart, timeline

        report["figures"] = {"bars": bar_chart(report, os.path.join(a.out, "memprof_bars.png")),
                             "timeline": timeline(raws, os.path.join(a.out, "memprof_timeline.png"))}
    with open(os.path.join(a.out, "memprof.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
