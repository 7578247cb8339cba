"""ES step throughput over pure inference on the embedded default: generated tokens/s of whole ES steps (perturb,
rollouts, restore, gather, update, ledger, checkpoints as the run writes them) over tokens/s of the same members'
rollouts with sigma = 0 and nothing else, interleaved step by step in one process (the machine's noise hits both).

The run's own settings decide everything (the 40-step run's noise work picks the noise backend); only the first
``steps`` steps are played. The compiled noise kernel's one-time cost is measured apart (``compile_s``) and reported
both in the first steps' figure and spread over the whole run, as a run pays it once.

Usage: python tools/bench_throughput.py [--steps 6] [key=value ...]   (prints one JSON object)
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from esopt_mp.profiling.record import print_record


def measure(steps: int, overrides: list[str]) -> dict:
    import torch

    from esopt_mp.es import population as members_of
    from esopt_mp.es.philox import kernel_cached
    from esopt_mp.core.types import Member
    from esopt_mp.parallel import LaunchEnv, init_distributed
    from esopt_mp.trainer import ESTrainer
    from tools.bench import _embedded_default

    warm = kernel_cached()  # what auto's choice rests on, before this run compiles anything
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _embedded_default([*overrides, f"run.dir={tmp}", "run.trajectories=false"])
        trainer = ESTrainer(cfg, init_distributed(LaunchEnv(0, 1, 0, "127.0.0.1", 0, "python"), 1, 1))
        try:
            p, es = trainer.perturber, cfg.es
            t0 = time.perf_counter()  # the noise kernel's one-time cost (a compile), as the first perturb pays it
            p.perturb(12345, 1e-30, 1)
            p.restore()
            compile_s = time.perf_counter() - t0
            seeds, signs = members_of(cfg.run.seed, 0, es.population, es.mirrored)
            t0 = time.perf_counter()  # the engine's first rollouts (kernels chosen, caches sized): paid by both
            trainer.objective.evaluate_member(Member(0, 0, seeds[0], signs[0], 0))
            warmup_s = time.perf_counter() - t0
            stats = trainer.engine.stats
            es_s = inf_s = 0.0
            es_tok = inf_tok = 0
            parts = {k: 0.0 for k in ("perturb_s", "restore_s", "update_s", "step_s", "rollout_s", "checkpoint_s")}
            per_step = []
            for t in range(steps):
                seeds, signs = members_of(cfg.run.seed, t, es.population, es.mirrored)
                row = {"step": t, "inference_first": t % 2 == 0}  # alternate: new shapes cost whoever meets them

                def inference():
                    n0, t1 = stats.decode_tokens, time.perf_counter()
                    for m in range(es.population):  # the same members' rollouts, unperturbed
                        trainer.objective.evaluate_member(Member(t, m, seeds[m], signs[m],
                                                                 m // 2 if es.mirrored else m))
                    trainer.objective.take_failures(), trainer.objective.take_trajectories()
                    trainer.objective.take_retried()
                    row["inference_s"], row["inference_tokens"] = time.perf_counter() - t1, stats.decode_tokens - n0

                if row["inference_first"]:
                    inference()
                n0, t1 = stats.decode_tokens, time.perf_counter()
                rec = trainer.step(t)
                if cfg.run.checkpoint_every and (t + 1) % cfg.run.checkpoint_every == 0:
                    t2 = time.perf_counter()
                    trainer.save(t + 1)
                    trainer.wait()
                    parts["checkpoint_s"] += time.perf_counter() - t2
                row["es_s"], row["es_tokens"] = time.perf_counter() - t1, stats.decode_tokens - n0
                for k in ("perturb_s", "restore_s", "update_s", "step_s", "rollout_s"):
                    parts[k] += rec[k]
                    row[k] = rec[k]
                if not row["inference_first"]:
                    inference()
                es_s, es_tok = es_s + row["es_s"], es_tok + row["es_tokens"]
                inf_s, inf_tok = inf_s + row["inference_s"], inf_tok + row["inference_tokens"]
                per_step.append(row)
                print(f"bench_throughput: step {t + 1}/{steps}: ES {row['es_s']:.1f} s, inference "
                      f"{row['inference_s']:.1f} s", file=sys.stderr)
            backend = sorted(set(p.backends.values()))
            params = p.numel
        finally:
            trainer.close()
    rest = parts["step_s"] - parts["rollout_s"] - parts["update_s"]  # gather, shaping, ledger, health
    rollouts = parts["rollout_s"] - parts["perturb_s"] - parts["restore_s"]
    es_rate, inf_rate = es_tok / es_s, inf_tok / inf_s
    run_steps = cfg.es.steps
    return {
        "config": "configs/config.yaml" + (f" with {' '.join(overrides)}" if overrides else " (unchanged)"),
        "torch_threads": torch.get_num_threads(), "params": params, "population": cfg.es.population,
        "run_steps": run_steps, "measured_steps": steps, "noise_backend": backend, "kernel_cache_warm": warm,
        "compile_s": compile_s,
        "engine_warmup_s": warmup_s,
        "steps": per_step,
        "es": {"seconds": es_s, "tokens": es_tok, "tokens_per_s": es_rate},
        "inference": {"seconds": inf_s, "tokens": inf_tok, "tokens_per_s": inf_rate},
        "parts_s_per_step": {"perturb": parts["perturb_s"] / steps, "restore": parts["restore_s"] / steps,
                             "update": parts["update_s"] / steps, "gather_ledger_rest": rest / steps,
                             "checkpoint": parts["checkpoint_s"] / steps, "rollouts": rollouts / steps,
                             "compile_once": compile_s},
        "headline": {"es_over_inference": es_rate / inf_rate,
                     # the one-time compile spread over the run it serves, as a run pays it
                     "es_over_inference_with_compile": es_tok / (es_s + compile_s * steps / run_steps) / inf_rate},
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog=os.environ.get("ESOPT_PROG"), description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="ES steps measured (of the run's es.steps)")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value), as launch/train.py takes them")
    a = ap.parse_args()
    print_record("throughput", measure(a.steps, a.overrides))


if __name__ == "__main__":
    main()
