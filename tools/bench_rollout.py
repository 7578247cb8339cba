"""Rollout throughput: the batched engine vs a per-episode ``model.generate`` loop; prefix reuse.

One JSON object, all measured in this run on the same tiny Qwen3.5 agent and the
same 32 multi-turn 4x4 Sudoku episodes (greedy, so every variant plays the same game):
- ``engine_reuse``: one generation batch per turn, per-conversation caches kept across turns;
- ``engine_reencode``: the same batch, the whole history re-encoded every turn;
- ``generate_loop``: episodes one after another, each turn ``model.generate`` on the full
  history (the way the reference ES code rolls out).

Usage: python tools/bench_rollout.py [--episodes 32] [--turns 4]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def _generate_loop(model, tok, tasks, turns, max_new):
    from esopt_mp.agent.chat import IM_END, delta_text, opening_text
    from esopt_mp.envs import make

    im_end = tok.convert_tokens_to_ids(IM_END)
    gen_tokens = prefill = 0
    all_ids = []
    for task in tasks:
        env = make("sudoku", max_turns=turns)
        msgs, _ = env.reset(task)
        ids = tok.encode(opening_text(msgs), add_special_tokens=False)
        for _ in range(turns):
            prefill += len(ids)
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=im_end, pad_token_id=tok.pad_token_id)
            new = out[0, len(ids):].tolist()
            gen_tokens += len(new)
            ids = ids + new
            text = tok.decode([t for t in new if t != im_end])
            msgs, _, term, trunc, _ = env.step(text)
            if term or trunc:
                break
            ids += tok.encode(delta_text(new[-1] == im_end, msgs), add_special_tokens=False)
        all_ids.append(ids)
    return gen_tokens, prefill, all_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    from esopt_mp.agent.loop import AgentConfig, run_episodes
    from esopt_mp.engine.hf import HFEngine
    from esopt_mp.engine.sampling import SamplingParams
    from esopt_mp.envs import make
    from esopt_mp.envs.sudoku import generate
    from esopt_mp.models.tiny import build_tiny_agent_base

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_agent_base(os.path.join(tmp, "agent"))
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        tok = AutoTokenizer.from_pretrained(path)
    tasks = generate(args.episodes, 4, size=4, seed=0)
    cfg = AgentConfig(max_turns=args.turns, sampling=SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens))
    result = {"episodes": args.episodes, "turns": args.turns, "max_new_tokens": args.max_new_tokens,
              "threads": torch.get_num_threads()}
    ids = {}
    for name, reuse in (("engine_reuse", True), ("engine_reencode", False)):
        engine = HFEngine(model, tok, prefix_reuse=reuse)
        envs = [make("sudoku", max_turns=args.turns) for _ in tasks]
        t = time.perf_counter()
        eps = run_episodes(engine, envs, tasks, list(range(len(tasks))), cfg)
        dt = time.perf_counter() - t
        ids[name] = [e.token_ids for e in eps]
        result[name] = {"seconds": dt, "generated_tokens": engine.stats.decode_tokens,
                        "tokens_per_s": engine.stats.decode_tokens / dt, "prefill_tokens": engine.stats.prefill_tokens,
                        "forward_calls": engine.stats.forward_calls}
    with torch.no_grad():
        t = time.perf_counter()
        gen, prefill, loop_ids = _generate_loop(model, tok, tasks, args.turns, args.max_new_tokens)
        dt = time.perf_counter() - t
    result["generate_loop"] = {"seconds": dt, "generated_tokens": gen, "tokens_per_s": gen / dt,
                               "prefill_tokens": prefill}
    result["speedup_engine_over_generate_loop"] = result["engine_reuse"]["tokens_per_s"] / (gen / dt)
    result["prefill_reduction_by_reuse"] = (result["engine_reencode"]["prefill_tokens"]
                                            / result["engine_reuse"]["prefill_tokens"])
    result["same_games"] = {"reuse_vs_reencode": ids["engine_reuse"] == ids["engine_reencode"],
                            "engine_vs_generate_loop": ids["engine_reuse"] == loop_ids}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
