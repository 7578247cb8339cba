"""One profile in this process: load the shape, run its workload under the sampler, report peaks.

Each profile runs in a fresh process (``tools/memprof.py`` starts one per
profile and rank), so a profile's peak never includes memory an earlier one
left behind in the allocator. Phases: ``load`` (from_pretrained; not part of
the peak: loading transients are not inference memory), then the measured
window: ``setup`` (Perturber / optimizer construction), ``perturb``,
``rollouts``, ``restore``, ``update``.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from esopt_mp.profiling.sampler import MemorySampler, ru_maxrss_bytes
from esopt_mp.profiling.workload import Workload, make_engine, run_rollouts, token_batch

log = logging.getLogger(__name__)

ES_MODES = {"es_subtract": ("subtract", "none"), "es_snapshot": ("snapshot", "none"),
            "es_snapshot_fp32_host": ("snapshot", "fp32_host")}
BASELINES = ("grpo", "ppo")
PROFILES = ("inference", *ES_MODES, *BASELINES)
WINDOW = ("setup", "perturb", "rollouts", "restore", "update")


@dataclasses.dataclass
class ProfileOptions:
    population: int = 2  # ES members per step (memory does not grow with it: members run one after another)
    sigma: float = 1e-3
    alpha: float = 1e-3
    chunk_elems: int = 1 << 24  # the trainer's es.chunk_elems default: profiles measure what training runs
    grad_checkpointing: bool = False
    seed: int = 0
    malloc_trim: bool = True  # free heap back to the kernel at each phase mark (MemorySampler): live memory per phase


def baselines_api():
    """``(build_baseline, AlgoConfig)``, imported only by the grpo/ppo profiles (they load the baselines' stack)."""
    from esopt_mp.baselines import build_baseline
    from esopt_mp.baselines.config import AlgoConfig

    return build_baseline, AlgoConfig


def _es_step(s: MemorySampler, model, engine, wl: Workload, name: str, opt: ProfileOptions) -> int:
    from esopt_mp.es.perturber import Perturber
    from esopt_mp.models.loading import build_shards

    restore, master = ES_MODES[name]
    s.mark("setup")
    # eager noise: torch.compile's one-off compiler memory (es.noise_backend=auto on a big CPU shard) would land in
    # the measured window; every backend gives the same noise and the same ES tensors (tests/unit/test_triton_noise)
    pert = Perturber(build_shards(model), restore=restore, master=master, chunk_elems=opt.chunk_elems,
                     noise_backend="eager")
    seeds = [opt.seed * 1000 + 17 + m // 2 for m in range(opt.population)]  # mirrored pairs, as es.mirrored
    signs = [1 if m % 2 == 0 else -1 for m in range(opt.population)]
    for m in range(opt.population):
        s.mark("perturb")
        pert.perturb(seeds[m], opt.sigma, signs[m])
        s.mark("rollouts")
        run_rollouts(engine, wl, opt.seed)
        s.mark("restore")
        pert.restore()
    s.mark("update")
    pert.update(seeds, signs, [1.0 if m % 2 == 0 else -1.0 for m in range(opt.population)], opt.alpha)
    return pert.host_bytes


def _baseline_step(s: MemorySampler, model, engine, wl: Workload, name: str, opt: ProfileOptions, dims) -> int:
    build_baseline, AlgoConfig = baselines_api()
    s.mark("rollouts")
    convs = run_rollouts(engine, wl, opt.seed)
    batch = token_batch(convs, wl, opt.seed)
    s.mark("setup")
    algo = build_baseline(name, model, AlgoConfig(name=name, generations=wl.group_size,
                                                  grad_checkpointing=opt.grad_checkpointing), dims)
    s.mark("update")
    algo.update(batch)
    return 0  # a real trainer keeps master weights and optimizer states on the device


@torch.no_grad()
def _make_resident(model) -> None:
    """Fault every local weight into anonymous memory, as a device would hold it (``x * 1 == x`` bit for bit).

    On CPU ``from_pretrained`` maps the safetensors file privately and lazily:
    untouched pages (embedding rows no prompt looks up) are not resident, so
    plain inference would look smaller than its weights while an ES perturb,
    which writes every element, copies the whole mapping.
    """
    for p in model.parameters():
        d = p.data
        (d.to_local() if hasattr(d, "to_local") else d).mul_(1)


def run_profile(name: str, ckpt: str, tp: int, wl: Workload, opt: ProfileOptions, interval_s: float = 0.01) -> dict:
    """Run profile ``name`` in this (fresh) process; world/rank come from the launcher's environment. The process
    group stays up: the caller writes the result first, then calls ``close_distributed`` (gloo can abort a rank
    in its teardown, which must not cost the profile)."""
    # everything the profile imports is imported before the baseline, so library code is not counted as memory
    import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: F401

    import esopt_mp.engine.hf  # noqa: F401
    import esopt_mp.es.perturber  # noqa: F401
    from esopt_mp.models.loading import load_model
    from esopt_mp.parallel import discover, init_distributed

    if name not in PROFILES:
        raise ValueError(f"--profiles: unknown profile {name!r}; known: {list(PROFILES)}")
    if name in BASELINES:
        baselines_api()
    le = discover()
    dims = init_distributed(le, dp=le.world_size // tp, tp=tp)
    s = MemorySampler(interval_s, malloc_trim=opt.malloc_trim).start()
    baseline = s.sample()[1]
    s.mark("load")
    t0 = time.perf_counter()
    model = load_model(ckpt, dims, "bfloat16")
    _make_resident(model)
    tok = AutoTokenizer.from_pretrained(ckpt)
    engine = make_engine(model, tok)
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    host_by_design = 0
    if name == "inference":
        s.mark("rollouts")
        run_rollouts(engine, wl, opt.seed)
    elif name in ES_MODES:
        host_by_design = _es_step(s, model, engine, wl, name, opt)
    else:
        host_by_design = _baseline_step(s, model, engine, wl, name, opt, dims)
    s.stop()
    step_s = time.perf_counter() - t1
    local = sum((p.data.to_local() if hasattr(p.data, "to_local") else p.data).numel() for p in model.parameters())
    return {"profile": name, "rank": dims.rank, "world": le.world_size, "tp": tp, "baseline_bytes": baseline,
            "window": s.peak(WINDOW), "phases": s.phase_peaks(), "host_by_design_bytes": host_by_design,
            "ru_maxrss_bytes": max(s.ru_maxrss_bytes, ru_maxrss_bytes()), "device_counter": s.device_counter,
            "nvml": s.nvml is not None,
            "hwm_resettable": s.hwm_resettable, "local_params": local,
            "decode_tokens": engine.stats.decode_tokens, "prefill_tokens": engine.stats.prefill_tokens,
            "load_s": load_s, "step_s": step_s, "timeline": s.timeline()}
