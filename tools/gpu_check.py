"""One GPU, one JSON line: hf vs vllm engines on a Qwen3.5 shape with random bf16 weights (tools/gpu_check.sh).

    python tools/gpu_check.py                   # 4B shape on CUDA
    python tools/gpu_check.py --shape tiny32    # the same code path on CPU (vLLM in reload mode), minutes
    python tools/gpu_check.py --engines hf      # the hf engine alone (vLLM is then reported as not available)

Per engine: generated tokens/s on a fixed multi-turn workload (EOS ignored,
every turn full length), the ES overhead of a step (perturb + restore per
member, one update) as a fraction of the step, and peak device memory of an
ES step over plain inference on the same workload (torch's peak allocated;
vLLM's KV budget fixed by --kv-gib, so the ratio compares like with like).
Then, for one member: whether vLLM's runtime tensors equal the fused/sharded
form of the hf engine's (bitwise, bf16), whether vLLM's own live tensors hold
them, and whether what vLLM computes moved with the perturbation and matches
the hf engine's next-token log-probs. With --graphs (CUDA graphs captured) the
last two say whether in-place edits reach the captured graphs.

Device memory is read twice: torch's allocator (``peak_*``: max_memory_allocated) and,
under ``memory``, a sampler every 10 ms (esopt_mp.profiling.MemorySampler: NVML's
figure for this process, else the device's used memory; torch's allocated and
reserved peaks; host RSS; on CPU the host figures alone).

Without vLLM (not installed, or it fails to import) the hf measurements are made
all the same and ``vllm`` reads ``{"available": false, "reason": ...}``; vLLM is not
imported at all unless it is asked for and the hf part is done. A part that fails
is reported with its error and traceback tail, and the JSON line is printed anyway
(exit status 1).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback


MEMBER = (20261130, 0.01, 1)
_T0 = time.perf_counter()


def _progress(msg: str) -> None:
    """One line on stderr per phase, with the seconds since start: a part cut off by its time limit says where."""
    print(f"[gpu_check {time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_reset():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak() -> int | None:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def workload(engine, vocab: int, batch: int, turns: int, new_tokens: int, seed: int = 0) -> tuple[int, float]:
    """(generated tokens, seconds) of ``batch`` conversations x ``turns`` turns, fixed prompts, EOS ignored."""
    import torch

    from esopt_mp.engine.base import SamplingParams

    g = torch.Generator().manual_seed(seed)
    convs = [engine.new_conversation(i, seed * 1009 + i) for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    engine.eos = set()
    n, t0 = 0, time.perf_counter()
    for turn in range(turns):
        prompts = [torch.randint(1, vocab, (32 if turn == 0 else 8,), generator=g).tolist() for _ in convs]
        n += sum(len(x.token_ids) for x in engine.generate(convs, prompts, params))
    _sync()
    return n, time.perf_counter() - t0


def es_steps(weights, engine, vocab, args, mark=None) -> dict:
    """Two ES steps of ``args.members`` members; ES cost = perturb + restore (+ reload) + update.

    One untimed perturb / restore / update first: Triton compiles its kernels on first use, which is
    not a per-step cost. ``mark``: called when the measured steps begin (the memory sampler's phase)."""
    weights.perturb(1, 0.01, 1)
    weights.restore()
    weights.update([1], [1], [0.0], 0.0)
    _sync()
    es_s = total = 0.0
    tokens = 0
    _peak_reset()
    if mark is not None:
        mark()
    for step in range(2):
        t_step = time.perf_counter()
        for m in range(args.members):
            t0 = time.perf_counter()
            weights.perturb(1000 * step + m, 0.01, 1)
            if hasattr(weights, "flush"):
                weights.flush()
            _sync()
            es_s += time.perf_counter() - t0
            n, _ = workload(engine, vocab, args.batch, args.turns, args.new_tokens, seed=m)
            tokens += n
            t0 = time.perf_counter()
            weights.restore()
            _sync()
            es_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        weights.update([1000 * step + m for m in range(args.members)], [1] * args.members,
                       [(-1.0) ** m for m in range(args.members)], 1e-4)
        _sync()
        es_s += time.perf_counter() - t0
        total += time.perf_counter() - t_step
        _progress(f"ES step {step + 1}/2: {time.perf_counter() - t_step:.1f}s")
    return {"es_overhead_fraction": round(es_s / total, 4), "es_step_s": round(total / 2, 3), "peak_es": _peak(),
            "es_tokens": tokens}


def run_engine(name: str, path: str, args) -> tuple[dict, object, object]:
    import torch

    from esopt_mp.engine.config import EngineConfig
    from esopt_mp.es.config import ESConfig
    from esopt_mp.parallel import ParallelDims

    dims = ParallelDims(1, 1, 1)
    dims.device_type = "cuda" if torch.cuda.is_available() else "cpu"
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f).get("vocab_size") or 1024
    if name == "hf":
        from esopt_mp.es import Perturber
        from esopt_mp.models import build_shards, load_model
        from esopt_mp.profiling.workload import make_engine
        from transformers import AutoTokenizer

        model = load_model(path, dims, "bfloat16")
        engine = make_engine(model, AutoTokenizer.from_pretrained(path))
        weights = Perturber(build_shards(model), restore="snapshot")
    else:
        from esopt_mp.engine.vllm import build_vllm

        ecfg = EngineConfig(name="vllm", max_model_len=1024, kv_cache_gib=args.kv_gib, enforce_eager=not args.graphs,
                            weight_sync=args.weight_sync)
        engine, weights, summary = build_vllm(ecfg, ESConfig(restore="snapshot"), path, dims, "bfloat16", 0)
    _progress(f"{name}: engine built")
    _peak_reset()
    workload(engine, vocab, args.batch, args.turns, args.new_tokens, seed=99)  # warm-up, not timed
    _progress(f"{name}: warm-up workload done")
    _peak_reset()
    sampler = _sampler()
    if sampler is not None:
        sampler.mark("inference")
    try:
        n, s = workload(engine, vocab, args.batch, args.turns, args.new_tokens)
        out = {"tokens_per_s": round(n / s, 1), "tokens": n, "peak_inference": _peak()}
        _progress(f"{name}: timed workload {n} tokens in {s:.1f}s")
        if name == "vllm":
            out["weight_sync"] = summary["sync"]
        out.update(es_steps(weights, engine, vocab, args,
                            mark=(lambda: sampler.mark("es")) if sampler is not None else None))
    finally:
        if sampler is not None:
            sampler.stop()
    if out["peak_inference"]:
        out["es_over_inference"] = round(out["peak_es"] / out["peak_inference"], 4)
    if sampler is not None:
        out["memory"] = memory_figures(sampler)
    return out, engine, weights


def _sampler():
    """A started MemorySampler (NVML where it can), or None if it cannot run here (no psutil)."""
    try:
        from esopt_mp.profiling.sampler import MemorySampler

        return MemorySampler(interval_s=0.01).start()
    except Exception:  # noqa: BLE001 - the figures without it are still worth having
        traceback.print_exc()
        return None


def memory_figures(sampler) -> dict:
    """Per phase (inference = the timed workload, es = the ES steps) the sampler's peaks, and ES over inference for
    each figure both phases have: device_peak_bytes (NVML), torch_max_allocated/reserved_bytes, host_peak_bytes."""
    inf, es = sampler.peak(["inference"]), sampler.peak(["es"])
    return {"counter": sampler.device_counter, "nvml": sampler.nvml is not None, "inference": inf, "es": es,
            "es_over_inference": {k: round(es[k] / inf[k], 4) for k in inf if k in es and inf[k]}}


PROMPT = [5, 77, 300, 12, 9, 450, 33, 100, 7, 64, 201, 19]


def _top(lp: dict, k: int = 5) -> dict[int, float]:
    return dict(sorted(lp.items(), key=lambda kv: -kv[1])[:k])


def hf_reference(model, weights) -> dict:
    """What the vllm engine must reproduce, kept on the host: the member's perturbed tensors and next-token
    log-probs (base and perturbed) of the hf engine. The hf model is freed afterwards."""
    import torch

    def logprobs():
        with torch.no_grad():
            lp = model(torch.tensor([PROMPT], device=next(model.parameters()).device)).logits[0, -1].float()
        top = lp.log_softmax(-1).topk(5)
        return dict(zip(top.indices.tolist(), top.values.tolist()))

    ref = {"base_lp": logprobs()}
    weights.perturb(*MEMBER)
    ref["pert_lp"] = logprobs()
    ref["tensors"] = {s.info.name: s.tensor.detach().to("cpu", copy=True) for s in weights.shards}  # tp=1: whole
    weights.restore()
    return ref


def _lp_diff(a: dict, b: dict) -> float:
    if max(a, key=a.get) != max(b, key=b.get):
        return float("inf")
    return round(max(abs(a[t] - b[t]) for t in set(a) & set(b)), 5)


def compare_with_hf(ref: dict, engine, weights) -> dict:
    """vLLM after the same member: runtime tensors bitwise vs the hf engine's, vLLM's own live tensors, and whether
    what vLLM computes moved and matches the hf engine (with CUDA graphs: whether in-place edits reach them)."""
    from vllm import SamplingParams

    from esopt_mp.engine.runtime_map import Piece, box_slices

    def logprobs():
        weights.flush()
        out = engine.llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, temperature=0,
                                                                                 logprobs=5), use_tqdm=False)
        return {t: x.logprob for t, x in out[0].outputs[0].logprobs[0].items()}

    base = logprobs()
    weights.perturb(*MEMBER)
    pert = logprobs()
    pieces = [Piece.from_json(d) for d in engine.llm.collective_rpc("esopt_pieces", args=(True,))[0]]
    runtime = engine.llm.collective_rpc("esopt_runtime")[0]
    bad = total = 0
    for p in pieces:
        got = p.view(runtime).reshape(-1)
        want = ref["tensors"][p.info.name][box_slices(p.info)].reshape(-1)
        total += got.numel()
        bad += int((got.to(want.dtype) != want).sum())
    live = engine.llm.collective_rpc("esopt_live_check")[0]
    weights.restore()
    return {"perturbed_elements": total, "perturbed_mismatch": bad, **live,
            "perturbation_moved_vllm_logprobs": _lp_diff(pert, base) > 1e-3,
            "base_logprob_diff_vs_hf": _lp_diff(base, ref["base_lp"]),
            "perturbed_logprob_diff_vs_hf": _lp_diff(pert, ref["pert_lp"])}


def vllm_unavailable(engines: list[str]) -> str | None:
    """Why vLLM cannot be measured here, or None: it is imported only now, after the hf part."""
    if "vllm" not in engines:
        return f"not asked for (--engines {','.join(engines)})"
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a build that fails on this machine at import
        return f"vllm does not import: {type(e).__name__}: {e}"
    return None


def _error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "traceback_tail": traceback.format_exc()[-1500:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default=None, help="Qwen3.5 shape (default: 4b on CUDA, tiny32 on CPU)")
    ap.add_argument("--engines", default="hf,vllm", help="comma-separated, of hf and vllm (default: both)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--weight-sync", default="auto")
    ap.add_argument("--graphs", action="store_true", help="vLLM with CUDA graphs (enforce_eager=false)")
    ap.add_argument("--dir", default=None, help="keep the random checkpoint here for a rerun (default: a temp dir)")
    args = ap.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    if not engines or set(engines) - {"hf", "vllm"}:
        ap.error(f"--engines takes hf and/or vllm, got {args.engines!r}")
    import torch

    from esopt_mp.profiling.shapes import write_random_checkpoint

    cuda = torch.cuda.is_available()
    shape = args.shape or ("4b" if cuda else "tiny32")
    t0 = time.perf_counter()
    res: dict = {"shape": shape, "device": torch.cuda.get_device_name() if cuda else "cpu",
                 "graphs": args.graphs}
    failed = False
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_random_checkpoint(shape, os.path.join(args.dir or tmp, shape))
            res["checkpoint_s"] = round(time.perf_counter() - t0, 1)
            _progress(f"random {shape} checkpoint ready")  # written now, or kept from a run before
            hf = hf_engine = hf_weights = None
            if "hf" in engines:
                try:
                    hf, hf_engine, hf_weights = run_engine("hf", path, args)
                    res["hf"] = hf
                except Exception as e:  # noqa: BLE001 - reported; vLLM is still measured
                    res["hf"], failed = _error(e), True
            reason = vllm_unavailable(engines)
            if reason:
                res["vllm"] = {"available": False, "reason": reason}
            else:
                ref = None
                if hf_engine is not None:
                    try:
                        ref = hf_reference(hf_engine.model, hf_weights)
                    except Exception as e:  # noqa: BLE001
                        res["hf_reference"], failed = _error(e), True
                del hf_engine, hf_weights  # vLLM's memory is measured without the hf model beside it
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                try:
                    vl, v_engine, v_weights = run_engine("vllm", path, args)
                    res["vllm"] = {"available": True, **vl}
                    try:
                        if ref is not None:
                            res.update(compare_with_hf(ref, v_engine, v_weights))
                        if hf is not None:
                            res["vllm_over_hf_tokens_per_s"] = round(vl["tokens_per_s"] / hf["tokens_per_s"], 3)
                    except Exception as e:  # noqa: BLE001
                        res["compare"], failed = _error(e), True
                    v_engine.close()
                except Exception as e:  # noqa: BLE001
                    res["vllm"], failed = {"available": True, **_error(e)}, True
    except Exception as e:  # noqa: BLE001 - the checkpoint, or what no part caught: the line is printed anyway
        res.update(_error(e))
        failed = True
    finally:
        res["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(res), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
