"""Build the embedded tiny agent: local tokenizer, tiny Qwen3.5 (1 Gated DeltaNet + 3 attention
layers), supervised warm start on scripted 4x4 Sudoku episodes, stopped while it still fails often.

    python tools/build_tiny_agent.py --out esopt_mp/assets/tiny_agent

Prints one JSON object (loss, held-out success and valid-action rate of the result) and
writes it next to the weights as warmstart.json. Nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

ENV = {"show_original": False, "hints": True}  # the embedded default's prompt (configs/env/sudoku4.yaml)
ARCH = dict(hidden_size=96, intermediate_size=256, num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "full_attention", "full_attention"])


def held_out_success(model, tok, tasks, max_turns: int) -> dict:
    from esopt_mp.agent.loop import AgentConfig, run_episodes
    from esopt_mp.engine.hf import HFEngine
    from esopt_mp.engine.base import SamplingParams
    from esopt_mp.envs import make

    envs = [make("sudoku", max_turns=max_turns, **ENV) for _ in tasks]
    eps = run_episodes(HFEngine(model, tok), envs, tasks, list(range(len(tasks))),
                       AgentConfig(max_turns, SamplingParams(temperature=0, max_new_tokens=10)))
    turns = [t for e in eps for t in e.turns]
    return {"success": sum(e.ret for e in eps) / len(eps),
            "valid_action_rate": sum(t["info"]["valid_action"] for t in turns) / max(1, len(turns))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--mask-count", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    torch.manual_seed(args.seed)
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    from esopt_mp.envs.sudoku import generate
    from esopt_mp.models.tiny import build_tiny_agent_base
    from tools.tiny_agent import build_tokenizer, encode_examples, train_sft_

    t0 = time.perf_counter()
    tmp = args.out + ".build"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(tmp + ".tok", ignore_errors=True)
    build_tokenizer(tmp + ".tok")  # trained on the environments' text (tools/tiny_agent.py)
    path = build_tiny_agent_base(tmp, seed=args.seed, tokenizer_dir=tmp + ".tok", **ARCH)
    shutil.rmtree(tmp + ".tok", ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    turns = 2 * args.mask_count
    # training puzzles come from seed 100+; the trainer's held-out puzzles use seeds 0 and 1
    train = generate(1000, args.mask_count, size=4, seed=100 + args.seed)
    examples = encode_examples(tok, train, turns, ENV)
    losses = train_sft_(model, examples, steps=args.steps, lr=3e-3, batch=16, seed=args.seed,
                        pad_id=tok.pad_token_id, log_every=0)
    report = {"steps": args.steps, "mask_count": args.mask_count, "final_loss": sum(losses[-20:]) / 20,
              "params": sum(p.numel() for p in model.parameters()), "seconds": time.perf_counter() - t0,
              **held_out_success(model, tok, generate(64, args.mask_count, size=4, seed=1), turns)}
    model.save_pretrained(tmp)
    with open(os.path.join(tmp, "warmstart.json"), "w") as f:
        json.dump(report, f, indent=1)
    shutil.rmtree(args.out, ignore_errors=True)
    os.replace(tmp, args.out)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
