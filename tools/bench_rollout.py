"""Rollout throughput on the shipped agent: the engine vs a batched and a per-episode ``model.generate``.

One JSON object, all measured in this run on the warm-started tiny Qwen3.5 agent shipped in
``esopt_mp/assets/tiny_agent`` playing the embedded default's 4x4 Sudoku (H*=3, candidate hints,
6 turns), greedy with real stop conditions: ``<|im_end|>`` / ``<|endoftext|>`` and the stop
string ``"\\n"`` (an action is one line), token cap ``engine.max_new_tokens``. Episodes end at
different turns (solved, invalid move, turn budget), so the live batch shrinks as they finish.
Presence penalty is off so every variant is plain argmax and must play the same games.

- ``engine_reuse``: esopt_mp/engine/hf.py, one batch per turn, per-conversation caches kept
  across turns (only what the environment added is prefilled);
- ``engine_reencode``: the same engine re-encoding each conversation's whole history every turn;
- ``batched_generate``: per turn, every live episode's whole history as one left-padded batch
  through ``model.generate`` (the best a stateless batched baseline does);
- ``generate_loop``: episodes one after another, each turn ``model.generate`` on the full
  history (the reference ES code's rollout).

``seconds`` is each variant's best of ``--repeats`` interleaved rounds: on a shared machine one
~1 s sample per variant swung the ratios tenfold between runs.

Usage: python tools/bench_rollout.py [--episodes 16] [--turns 6] [--max-new-tokens 10] [--repeats 3]
"""
from __future__ import annotations

import argparse
import collections
import os
import time

from esopt_mp.profiling.record import print_record

import torch

AGENT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "esopt_mp", "assets", "tiny_agent")
ENV_KW = {"show_original": False, "hints": True}  # configs/env/sudoku4.yaml
STOP = ("\n",)


class _Play:
    """The environment side of a rollout for the ``model.generate`` baselines (same ChatML deltas as the loop)."""

    def __init__(self, tok, tasks, turns):
        from esopt_mp.chat.format import IM_END, opening_text
        from esopt_mp.envs import make

        self.tok, self.turns = tok, turns
        self.im_end = tok.convert_tokens_to_ids(IM_END)
        self.eos = {self.im_end, tok.convert_tokens_to_ids("<|endoftext|>")}
        self.envs = [make("sudoku", max_turns=turns, **ENV_KW) for _ in tasks]
        self.ids = [tok.encode(opening_text(env.reset(t)[0]), add_special_tokens=False)
                    for env, t in zip(self.envs, tasks)]
        self.n_turns = [0] * len(tasks)
        self.replies: list[tuple[int, str]] = []  # (tokens, finish) per reply

    def trim(self, new: list[int], cap: int) -> tuple[list[int], str]:
        """The reply as the engine ends it: through the first EOS, else the stop string, else the cap."""
        for k, t in enumerate(new):
            if t in self.eos:
                return new[: k + 1], "eos"
            if any(s in self.tok.decode(new[: k + 1]) for s in STOP):
                return new[: k + 1], "stop"
        return new[:cap], "length"

    def step(self, i: int, reply: list[int], finish: str) -> bool:
        """Apply episode i's reply; True while it goes on."""
        from esopt_mp.chat.format import delta_text

        self.replies.append((len(reply), finish))
        self.ids[i] = self.ids[i] + reply
        text = self.tok.decode([t for t in reply if t not in self.eos])
        for s in STOP:
            text = text[: text.find(s)] if s in text else text
        msgs, _, term, trunc, _ = self.envs[i].step(text)
        self.n_turns[i] += 1
        if term or trunc or self.n_turns[i] >= self.turns:
            return False
        self.ids[i] += self.tok.encode(delta_text(reply[-1] == self.im_end, msgs), add_special_tokens=False)
        return True


_STOPPING: dict = {}


def _gen_kwargs(tok, play, cap):
    """Greedy, EOS ids and the stop string; the stop-string criterion is built once (it costs ~0.5 s)."""
    from transformers import StoppingCriteriaList, StopStringCriteria

    if id(tok) not in _STOPPING:
        _STOPPING[id(tok)] = StoppingCriteriaList([StopStringCriteria(tok, list(STOP))])
    return dict(max_new_tokens=cap, do_sample=False, eos_token_id=sorted(play.eos), pad_token_id=tok.pad_token_id,
                stopping_criteria=_STOPPING[id(tok)])


def _generate_loop(model, tok, tasks, turns, cap):
    play = _Play(tok, tasks, turns)
    prefill = 0
    for i in range(len(tasks)):
        while True:
            prefill += len(play.ids[i])
            out = model.generate(torch.tensor([play.ids[i]]), **_gen_kwargs(tok, play, cap))
            if not play.step(i, *play.trim(out[0, len(play.ids[i]):].tolist(), cap)):
                break
    return play, {"prefill_tokens": prefill, "generate_calls": len(play.replies)}


def _batched_generate(model, tok, tasks, turns, cap):
    play = _Play(tok, tasks, turns)
    live, prefill, padded, calls = list(range(len(tasks))), 0, 0, 0
    while live:
        width = max(len(play.ids[i]) for i in live)
        pad = tok.pad_token_id
        batch = torch.tensor([[pad] * (width - len(play.ids[i])) + play.ids[i] for i in live])
        mask = torch.tensor([[0] * (width - len(play.ids[i])) + [1] * len(play.ids[i]) for i in live])
        prefill += int(mask.sum())
        padded += batch.numel()
        out = model.generate(batch, attention_mask=mask, **_gen_kwargs(tok, play, cap))
        calls += 1
        live = [i for r, i in enumerate(live) if play.step(i, *play.trim(out[r, width:].tolist(), cap))]
    return play, {"prefill_tokens": prefill, "padded_prefill_tokens": padded, "generate_calls": calls}


def _figures(seconds, replies, extra):
    gen = sum(n for n, _ in replies)
    finish = collections.Counter(f for _, f in replies)
    return {"seconds": seconds, "generated_tokens": gen, "tokens_per_s": gen / seconds, "replies": len(replies),
            "finish": dict(finish), "cap_fraction": finish.get("length", 0) / max(1, len(replies)), **extra}


def run(episodes: int = 16, turns: int = 6, max_new_tokens: int = 10, repeats: int = 3) -> dict:
    """Every variant on the same games; the figures described in the module docstring (tools/bench.py calls it)."""
    args = argparse.Namespace(episodes=episodes, turns=turns, max_new_tokens=max_new_tokens, repeats=repeats)
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    from esopt_mp.agent.loop import AgentConfig, run_episodes
    from esopt_mp.engine.hf import HFEngine
    from esopt_mp.engine.base import SamplingParams
    from esopt_mp.envs import make
    from esopt_mp.envs.sudoku import generate

    model = AutoModelForCausalLM.from_pretrained(AGENT).eval()
    tok = AutoTokenizer.from_pretrained(AGENT)
    tasks = generate(args.episodes, 3, size=4, seed=0)
    params = SamplingParams(temperature=0, presence_penalty=0.0, max_new_tokens=args.max_new_tokens, stop=STOP)
    cfg = AgentConfig(max_turns=args.turns, sampling=params)
    result = {"model": "esopt_mp/assets/tiny_agent", "episodes": args.episodes, "turns": args.turns,
              "max_new_tokens": args.max_new_tokens, "stop": list(STOP), "threads": torch.get_num_threads(),
              "repeats": args.repeats}
    with torch.no_grad():  # warm-up, untimed: first-call costs stay out of every variant's figure
        envs = [make("sudoku", max_turns=args.turns, **ENV_KW) for _ in tasks[:2]]
        run_episodes(HFEngine(model, tok), envs, tasks[:2], [0, 1], cfg)
        _batched_generate(model, tok, tasks[:2], 1, args.max_new_tokens)
    def engine_variant(reuse):
        def run():
            engine = HFEngine(model, tok, prefix_reuse=reuse)
            envs = [make("sudoku", max_turns=args.turns, **ENV_KW) for _ in tasks]
            eps = run_episodes(engine, envs, tasks, list(range(len(tasks))), cfg)
            replies = [(tr["response_tokens"], tr["finish"]) for e in eps for tr in e.turns]
            stats = {k: v for k, v in vars(engine.stats).items() if k != "decode_tokens"}  # prefill plan used
            extra = {**stats, "mean_return": sum(e.ret for e in eps) / len(eps)}
            return replies, extra, [e.token_ids for e in eps], [len(e.turns) for e in eps]
        return run

    def generate_variant(fn):
        def run():
            play, extra = fn(model, tok, tasks, args.turns, args.max_new_tokens)
            return play.replies, extra, play.ids, None
        return run

    variants = {"engine_reuse": engine_variant(True), "engine_reencode": engine_variant(False),
                "batched_generate": generate_variant(_batched_generate),
                "generate_loop": generate_variant(_generate_loop)}
    best, runs = {}, {}
    with torch.no_grad():
        for _ in range(args.repeats):  # rounds over all variants, so each sees the machine's load alike
            for name, run in variants.items():
                t = time.perf_counter()
                runs[name] = run()
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
    ids = {name: r[2] for name, r in runs.items()}
    for name, (replies, extra, _, _) in runs.items():
        result[name] = _figures(best[name], replies, extra)
    lengths = runs["engine_reuse"][3]
    eng = result["engine_reuse"]["tokens_per_s"]
    result["episode_turns"] = dict(sorted(collections.Counter(lengths).items()))
    result["speedup_engine_over_batched_generate"] = eng / result["batched_generate"]["tokens_per_s"]
    result["speedup_engine_over_generate_loop"] = eng / result["generate_loop"]["tokens_per_s"]
    result["speedup_batched_generate_over_generate_loop"] = (result["batched_generate"]["tokens_per_s"]
                                                             / result["generate_loop"]["tokens_per_s"])
    result["prefill_reduction_by_reuse"] = (result["engine_reencode"]["prefill_tokens"]
                                            / result["engine_reuse"]["prefill_tokens"])
    result["same_games"] = {k: ids["engine_reuse"] == ids[k]
                            for k in ("engine_reencode", "batched_generate", "generate_loop")}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(prog=os.environ.get("ESOPT_PROG"), description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=16, help="16 = the embedded default's episodes per step")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=10, help="the token cap (configs/engine/hf.yaml)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed rounds; each variant's best (least disturbed) wall time is reported")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS") or os.environ.get("OMP_NUM_THREADS") or 2))
    print_record("rollout", run(args.episodes, args.turns, args.max_new_tokens, args.repeats))


if __name__ == "__main__":
    main()
