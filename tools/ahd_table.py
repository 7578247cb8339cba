"""Heuristic-design comparison at equal budget: problem x {Sample, Sample+ES, EoH, EoH+ES}, mean and spread over seeds.

    python tools/ahd_table.py [--problems bpp_online tsp_constructive] [--seeds 0 1] [--steps 3] [--population 4]
                              [--episodes 2] [--model builtin:tiny_agent] [--out runs/ahd_table]

Each cell runs the ES trainer with a prompt optimiser (esopt_mp/prompt): Sample and EoH alone are
``prompt.mode=prompt_only`` (the weights never move), the +ES variants ``joint`` (the same trajectories update
the weights and the context every step) with the test-time sigma schedule: cosine to sigma_T = 0 at the last
step. All four play population x episodes x turns programs per step, so the budget is equal by construction; it
is also counted from the ledgers and asserted equal per (problem, seed). The figure is the problem's objective
(the paper's: tour length, value, bins or cost, lower or higher as the problem says) of the search's best
program on held-out instances (the test split, else validation; bpp_online: generated from a test seed); a run
that found no valid program reports its seed heuristic. One JSON object on stdout, a markdown table in --out.
With the tiny CPU agent the numbers are weak (it rarely writes valid code); the mechanics are what it shows.

    python tools/ahd_table.py --paper [--paper-seeds 10] [--bpp-modes sample aco] [--first K]

scores the paper's own final programs (``data:ahd/paper_programs``) with our evaluators beside the objectives
the paper recorded for them (constructive problems once; the ACO problems over seeds: mean, sd, min, max) and
prints one JSON object; ``within``: |ours - recorded| <= 0.2% (constructive) or <= 2 sd over the seeds (ACO;
offline bin packing's colony mode is shown beside the recorded sample-mode figure, ``within`` null).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


METHODS = {"Sample": ("sample", "prompt_only"), "Sample+ES": ("sample", "joint"),
           "EoH": ("eoh", "prompt_only"), "EoH+ES": ("eoh", "joint")}


def run_cell(problem: str, method: str, seed: int, args, run_dir: str) -> dict:
    """One search; its best program's held-out objective and the number of programs it evaluated."""
    from esopt_mp.config import build_config
    from esopt_mp.parallel import LaunchEnv, init_distributed
    from esopt_mp.prompt import EoHSearch, SampleSearch
    from esopt_mp.trainer import ESTrainer

    optimiser, mode = METHODS[method]
    cfg = build_config({
        "run": {"dir": run_dir, "trajectories": False, "checkpoint_every": 0, "log_every": 1, "seed": seed},
        "model": {"path": args.model}, "objective": {"name": "agent"},
        "es": {"population": args.population, "steps": args.steps, "mirrored": False,
               "sigma": {"kind": "cosine", "start": args.sigma, "end": 0.0},  # ends at 0 on the last step
               "alpha": {"kind": "constant", "start": args.alpha, "end": args.alpha}},
        "env": {"name": "heuristic", "heuristic": {"problem": problem}, "max_turns": args.turns, "n_train": args.episodes,
                "n_eval": 1, "episodes_per_step": args.episodes, "task_seed": seed},
        "engine": {"max_new_tokens": args.max_new_tokens, "temperature": 1.0},
        "prompt": {"optimiser": optimiser, "mode": mode, "population": args.eoh_size},
    })
    trainer = ESTrainer(cfg, init_distributed(LaunchEnv(0, 1, 0, "127.0.0.1", 0, "python"), 1, 1))
    try:
        for t in range(trainer.start_step, args.steps):
            trainer.step(t)
        best = (SampleSearch if optimiser == "sample" else EoHSearch).best(trainer.context.text)
        programs, valid = trainer.context.programs, trainer.context.valid
    finally:
        trainer.close()
    return {"objective": held_out(problem, best["code"], seed), "train_score": best["fitness"],
            "programs": programs, "valid_programs": valid, "context": trainer.context.hash,
            "seed_fitness": trainer.context.seed_fitness}  # evaluated once, outside the budget


def held_out(problem: str, code: str, seed: int) -> float:
    """The problem's objective of ``code`` on one held-out task, in the sandbox with the problem's limits."""
    from esopt_mp.envs import ahd
    from esopt_mp.envs.sandbox import Sandbox, SandboxConfig

    prob = ahd.get(problem)
    try:
        shipped = [] if getattr(prob, "generated", False) else prob.splits()
    except FileNotFoundError:  # asp_constructive: one constructed instance whatever the split
        shipped = []
    split = "val" if shipped and "test" not in shipped else "test"
    task = ahd.generate_tasks(problem, 1, seed=1000 + seed, split=split)[0]
    res = prob.evaluate(code, prob.task_instances(task), Sandbox.from_config(SandboxConfig(), prob.limits),
                        seed=int(task.get("seed", 0)))
    return float(res.objective)


def table(results: dict, problems: list[str]) -> str:
    from esopt_mp.envs import ahd

    head = "| problem (objective, better) | " + " | ".join(METHODS) + " | programs/run |"  # valid: over all seeds
    lines = [head, "|" + "---|" * (len(METHODS) + 2)]
    for p in problems:
        prob = ahd.get(p)
        cells = []
        for m in METHODS:
            xs = [r["objective"] for r in results[p][m]]
            sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
            valid = sum(r["valid_programs"] for r in results[p][m])
            cells.append(f"{statistics.mean(xs):.4f} ± {sd:.4f} ({valid} valid)")
        budget = results[p]["Sample"][0]["programs"]
        lines.append(f"| {p} ({prob.objective_key}, {'lower' if prob.sense == 'min' else 'higher'}) | "
                     + " | ".join(cells) + f" | {budget} |")
    return "\n".join(lines) + "\n"


def paper(args) -> dict:
    """The paper's programs on our evaluators (see the module docstring)."""
    import dataclasses

    from esopt_mp.envs.ahd import paper as pp

    rows = []
    for r in pp.table(seeds=range(args.paper_seeds), first=args.first, bpp_modes=args.bpp_modes,
                      problems=args.problems):
        stochastic = r.problem in pp.STOCHASTIC
        ok = r.error is None and (abs(r.ours - r.recorded) <= 2 * r.sd if stochastic else abs(r.rel_diff) <= 2e-3)
        if r.mode == "aco":  # the paper recorded "sample" mode; the colony's figure is shown beside it, not compared
            ok = None
        rows.append(dict(dataclasses.asdict(r), rel_diff=r.rel_diff, within=ok))
    return {"paper_programs": rows, "source_commit": pp.manifest()["source_commit"], "all_within": all(
        r["within"] for r in rows if r["within"] is not None)}


def main() -> None:
    from esopt_mp.envs import ahd

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", nargs="+", default=ahd.known(), choices=ahd.known())
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--population", type=int, default=4, help="ES population (members per step)")
    ap.add_argument("--episodes", type=int, default=2, help="episodes per member per step")
    ap.add_argument("--turns", type=int, default=1, help="programs per episode")
    ap.add_argument("--eoh-size", type=int, default=4)
    ap.add_argument("--sigma", type=float, default=1e-3)
    ap.add_argument("--alpha", type=float, default=5e-4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--model", default="builtin:tiny_agent")
    ap.add_argument("--out", default="runs/ahd_table")
    ap.add_argument("--paper", action="store_true", help="score the paper's final programs instead (no search)")
    ap.add_argument("--paper-seeds", type=int, default=10, help="--paper: colony seeds per ACO figure")
    ap.add_argument("--bpp-modes", nargs="+", default=["sample", "aco"], choices=["sample", "aco"])
    ap.add_argument("--first", type=int, default=None, help="--paper: only the first K instances of each set")
    args = ap.parse_args()
    if args.paper:
        try:
            print(json.dumps(paper(args)))
        except FileNotFoundError as e:  # a test split not built yet: the line names the command that builds it
            sys.exit(f"ahd_table --paper: {e}")
        return
    import torch

    torch.set_num_threads(1)
    results: dict = {}
    for p in args.problems:
        results[p] = {m: [] for m in METHODS}
        for seed in args.seeds:
            for m in METHODS:
                d = os.path.join(args.out, p, m.replace("+", "_"), f"seed{seed}")
                results[p][m].append(dict(run_cell(p, m, seed, args, d), seed=seed))
            counts = {m: results[p][m][-1]["programs"] for m in METHODS}
            if len(set(counts.values())) != 1:
                raise AssertionError(f"{p} seed {seed}: unequal budgets {counts}")
    os.makedirs(args.out, exist_ok=True)
    md = table(results, args.problems)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(md)
    print(json.dumps({"results": results, "table": os.path.join(args.out, "table.md"),
                      "budget_equal": True, "settings": vars(args)}))


if __name__ == "__main__":
    main()
