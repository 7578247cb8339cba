"""Population throughput: a low-rank ES step with every member in one batch, against pure batch inference.

For each population size G, the same G x E sequences (E episodes per member, a prompt each, exactly T new tokens:
EOS is ignored so every mode generates the same number) are generated through the hf engine four ways, each in its
own process (its peak RSS is its own), interleaved G by G:

- ``inference``: the unperturbed model, all G x E sequences in one batch (EGGROLL's anchor: batch inference);
- ``lowrank_batch``: es.noise=lowrank with es.member_batch: the G members' factors made, then one batch in which
  every row adds its member's rank-r term (engine/members.py); the weights are never touched;
- ``lowrank_seq``: the same low-rank members perturbed in place one after another, E sequences each;
- ``fullrank_seq``: the paper's method: each member's full-rank noise added in place, its E sequences, restored.

A step's ES update (G members) is timed in the same process for the three ES modes (``update_s``), so
``step_tokens_per_s`` = tokens / (generation + ES ops + update) is what a step delivers. Ratios are taken within
this run (the machine's load hits every mode alike): ``vs_inference`` (EGGROLL reports 0.91 for its low-rank step,
0.0041 for full-rank OpenES) and ``vs_fullrank``. The compiled noise kernel's one-time compile is done before the
clock starts (a run pays it once).

On a GPU the model and the noise run there and each mode's device peak (torch's allocator) is reported too.

Usage: python tools/bench_members.py [--model builtin|smollm2|DIR] [--G 8 16 64] [--episodes 4] [--tokens 32]
       [--rank 1] [--threads 2] [--dtype float32]      (prints one JSON object; --out FILE also writes it)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from esopt_mp.profiling.record import print_record

MODES = ("inference", "lowrank_batch", "lowrank_seq", "fullrank_seq")
MODELS = {"builtin": "builtin:tiny_agent", "smollm2": "pypi:smollm2-135m-instruct"}
SIGMA = 2e-3  # the real-model profiles' starting sigma; the speed does not depend on it


def _model_dir(spec: str) -> str:
    from esopt_mp.models.gguf import converted_dir, is_gguf_source
    from esopt_mp.models.paths import ASSETS

    spec = MODELS.get(spec, spec)
    if spec.startswith("builtin:"):
        return os.path.join(ASSETS, spec[len("builtin:"):])
    return converted_dir(spec) if is_gguf_source(spec) else spec


def _prompts(tok, n: int) -> list[list[int]]:
    """n distinct prompts of a few dozen tokens (arithmetic questions in the chat format)."""
    from esopt_mp.chat.format import opening_text

    out = []
    for i in range(n):
        a, b = 17 + 7 * i % 83, 5 + 13 * i % 71
        msgs = [{"role": "system", "content": "You are a careful assistant. End with a line 'Answer: X'."},
                {"role": "user", "content": f"What is {a} + {b} - {i % 9}? Think step by step."}]
        out.append(tok.encode(opening_text(msgs), add_special_tokens=False))
    return out


def child(mode: str, g: int, args) -> dict:
    """One (mode, G) measurement in this process."""
    import torch
    from transformers import AutoTokenizer

    from esopt_mp.engine.base import SamplingParams
    from esopt_mp.engine.hf import HFEngine
    from esopt_mp.engine.members import MemberLinears
    from esopt_mp.es import Perturber, population
    from esopt_mp.models import build_shards, load_model
    from esopt_mp.parallel import ParallelDims

    torch.set_num_threads(args.threads)
    path = _model_dir(args.model)
    dims = ParallelDims(1, 1, 1)
    cuda = torch.cuda.is_available()
    dims.device_type = "cuda" if cuda else "cpu"
    model = load_model(path, dims, args.dtype)
    tok = AutoTokenizer.from_pretrained(path)
    rss_model = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    e, t_new = args.episodes, args.tokens
    prompts = _prompts(tok, g * e)
    params = SamplingParams(temperature=1.0, max_new_tokens=t_new)
    seeds, signs = population(0, 0, g, True)
    weights = None
    if mode != "inference":
        weights = Perturber(build_shards(model), noise="full" if mode == "fullrank_seq" else "lowrank",
                            rank=args.rank, work_passes=3 * g)
    if mode == "fullrank_seq":  # its noise kernel compiled (if auto chose to) before the clock starts
        weights.perturb(seeds[0], SIGMA, 1)
        weights.restore()
    members = MemberLinears(model, weights) if mode == "lowrank_batch" else None
    engine = HFEngine(model, tok, members=members)
    engine.eos = set()  # exactly t_new tokens per sequence, whatever they are
    es_s = 0.0
    sync()
    t0 = time.perf_counter()
    if mode in ("inference", "lowrank_batch"):
        if members is not None:
            t1 = time.perf_counter()
            members.set_members(seeds, signs, SIGMA)
            es_s += time.perf_counter() - t1
        slots = [k // e for k in range(g * e)] if members is not None else [-1] * (g * e)
        convs = [engine.new_conversation(k, k, **({"member": s} if members is not None else {}))
                 for k, s in enumerate(slots)]
        gens = engine.generate(convs, prompts, params)
    else:
        gens = []
        for m in range(g):
            t1 = time.perf_counter()
            weights.perturb(seeds[m], SIGMA, signs[m])
            sync()
            es_s += time.perf_counter() - t1
            convs = [engine.new_conversation(k, k) for k in range(m * e, (m + 1) * e)]
            gens += engine.generate(convs, prompts[m * e : (m + 1) * e], params)
            t1 = time.perf_counter()
            weights.restore()
            sync()
            es_s += time.perf_counter() - t1
    sync()
    gen_s = time.perf_counter() - t0
    tokens = sum(len(x.token_ids) for x in gens)
    update_s = 0.0
    if weights is not None:
        t1 = time.perf_counter()
        weights.update(seeds, signs, [((-1) ** k) * 0.5 for k in range(g)], 1e-3)
        sync()
        update_s = time.perf_counter() - t1
    return {"mode": mode, "G": g, "sequences": g * e, "tokens": tokens, "seconds": gen_s, "es_ops_s": es_s,
            "update_s": update_s, "tokens_per_s": tokens / gen_s,
            "step_tokens_per_s": tokens / (gen_s + update_s), "peak_rss_bytes":
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss_after_load_bytes": rss_model,
            "device_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "backends": sorted(set(weights.backends.values())) if weights is not None else None}


def measure(args) -> dict:
    rows = []
    for g in args.G:
        for mode in args.modes:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--G", str(g), "--model", args.model,
                   "--episodes", str(args.episodes), "--tokens", str(args.tokens), "--rank", str(args.rank),
                   "--threads", str(args.threads), "--dtype", args.dtype]
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            if out.returncode != 0:
                raise SystemExit(f"bench_members: {mode} at G={g} failed:\n{out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"[bench_members] G={g} {mode}: {row['tokens_per_s']:.1f} tokens/s generating, "
                  f"{row['step_tokens_per_s']:.1f} with the update, peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB",
                  file=sys.stderr, flush=True)
    table = {}
    for g in args.G:
        by = {r["mode"]: r for r in rows if r["G"] == g}
        base = by.get("inference")
        full = by.get("fullrank_seq")
        table[str(g)] = {m: {"tokens_per_s": r["step_tokens_per_s"],
                             "vs_inference": r["step_tokens_per_s"] / base["tokens_per_s"] if base else None,
                             "vs_fullrank": r["step_tokens_per_s"] / full["step_tokens_per_s"] if full else None,
                             "peak_rss_vs_inference": r["peak_rss_bytes"] / base["peak_rss_bytes"] if base else None,
                             **({"device_peak_vs_inference": r["device_peak_bytes"] / base["device_peak_bytes"]}
                                if base and base["device_peak_bytes"] else {})}
                         for m, r in by.items()}
    return {"model": MODELS.get(args.model, args.model), "episodes_per_member": args.episodes,
            "new_tokens": args.tokens, "rank": args.rank, "sigma": SIGMA, "threads": args.threads,
            "table": table, "runs": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=os.environ.get("ESOPT_PROG"), description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin", help="builtin (the tiny agent), smollm2, or a model directory")
    ap.add_argument("--G", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--episodes", type=int, default=4, help="sequences per member")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per sequence")
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.G[0], args)))
        return 0
    rec = print_record("members", measure(args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
