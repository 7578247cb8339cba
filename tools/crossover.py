"""The horizon crossover in miniature: ES, GRPO and PPO on the tiny agent at increasing horizons, on any environment.

    python tools/crossover.py                                   # 4x4 Sudoku, H* 2 4 6, 3 seeds, 2048 episodes per run
    python tools/crossover.py --horizons 2 6 --seeds 0 --budget 256 --jobs 2 --out runs/crossover
    python tools/crossover.py --env gymnasium --horizon-key env.max_turns --turns-per-horizon 0 --horizons 8 16 32 \
        env.gymnasium.id=FrozenLake-v1                         # any environment: which key the horizon sets

The horizon is one integer setting, ``--horizon-key`` (default: Sudoku's blanks, ``env.sudoku.mask_count``), and
the turn budget follows it (``env.max_turns = --turns-per-horizon x horizon``; 0 leaves ``env.max_turns`` to the
overrides). Extra Hydra overrides (an experiment profile, the environment's section) go to every run.

Every (method, H*, seed) is one `python launch/train.py` run in its own directory under ``--out``
(a finished run is reused when the command is repeated, so an interrupted sweep loses nothing).
Equal rollout budget: every method plays the same number of training episodes per step and the
same number of steps (ES: population x episodes per member; GRPO/PPO: tasks x generations); the
script checks it up front from the settings and afterwards by counting the training episodes each
run actually wrote to its trajectories.jsonl.
The held-out return (greedy, the same tasks for every method at a given horizon) before and after
training is what the plot shows, as mean and min..max over seeds. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time

from tqdm.auto import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from esopt_mp.profiling.record import print_record

from esopt_mp.runfiles import read_jsonl
METHODS = ("es", "grpo", "ppo")
SUDOKU_HORIZON = "env.sudoku.mask_count"


def plan(args) -> list[dict]:
    """One entry per run: its overrides and the training episodes it must play."""
    es_per_step = args.es_population * args.es_episodes
    pg_per_step = args.pg_tasks * args.pg_generations
    if es_per_step != pg_per_step:
        raise SystemExit(f"unequal rollout budget per step: ES {args.es_population} x {args.es_episodes} = "
                         f"{es_per_step} vs GRPO/PPO {args.pg_tasks} x {args.pg_generations} = {pg_per_step}")
    if args.budget % es_per_step:
        raise SystemExit(f"--budget {args.budget} is not a multiple of the {es_per_step} episodes per step")
    steps = args.budget // es_per_step
    runs = []
    for h in args.horizons:
        if args.horizon_key == SUDOKU_HORIZON and args.env == "sudoku" and not 1 <= h <= 15:
            raise SystemExit(f"--horizons: H* = {h} is outside 1..15 for a 4x4 board")
        if h < 1:
            raise SystemExit(f"--horizons: {h} is not a horizon (>= 1)")
        turns = [f"env.max_turns={args.turns_per_horizon * h}"] if args.turns_per_horizon else []
        for seed in args.seeds:
            for m in args.methods:
                common = [f"env.name={args.env}", f"{args.horizon_key}={h}", *turns, f"env.n_eval={args.n_eval}",
                          "run.eval_every=0", "run.checkpoint_every=0", "run.export=false", "run.trajectories=true",
                          f"env.task_seed={args.task_seed}"]
                if m == "es":  # run.seed is every method's run seed (tasks, episodes, noise)
                    over = [f"run.seed={seed}", f"es.steps={steps}", f"es.population={args.es_population}",
                            f"env.episodes_per_step={args.es_episodes}"]
                else:
                    over = [f"algo={m}", f"run.seed={seed}", f"algo.steps={steps}",
                            f"algo.tasks_per_step={args.pg_tasks}", f"algo.generations={args.pg_generations}"]
                d = os.path.join(args.out, f"h{h}", f"{m}_s{seed}")
                runs.append({"method": m, "horizon": h, "seed": seed, "dir": d, "episodes": args.budget,
                             "overrides": common + over + list(args.overrides) + [f"run.dir={d}"]})
    return runs


def _summary(run_dir: str) -> dict | None:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    found = [r["summary"] for r in read_jsonl(path) if "summary" in r]  # a line a crash tore is skipped
    return found[-1] if found else None


def _train_episodes(run_dir: str) -> int:
    return sum(1 for r in read_jsonl(os.path.join(run_dir, "trajectories.jsonl")) if r.get("kind") == "train")


def execute(run: dict, threads: int) -> dict:
    """Run (or reuse) one training run; its held-out success before/after and its episode count."""
    s = _summary(run["dir"])
    t = time.perf_counter()
    if s is None:
        if os.path.exists(run["dir"]):
            import shutil

            shutil.rmtree(run["dir"])  # an unfinished run: start it again from scratch
        env = dict(os.environ, ESOPT_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
        proc = subprocess.run([sys.executable, "launch/train.py", *run["overrides"]], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{run['method']} H*={run['horizon']} seed {run['seed']} failed "
                               f"(exit {proc.returncode}):\n{proc.stderr[-2500:]}")
        s = _summary(run["dir"])
    played = _train_episodes(run["dir"])
    if played != run["episodes"]:
        raise RuntimeError(f"{run['dir']}: played {played} training episodes, the budget is {run['episodes']}")
    return {k: run[k] for k in ("method", "horizon", "seed", "episodes")} | {
        "before": s["eval_before"], "after": s["eval_after"], "seconds": round(s.get("seconds") or time.perf_counter() - t, 1)}


def aggregate(results: list[dict]) -> dict:
    out = {}
    for m in sorted({r["method"] for r in results}):
        out[m] = {}
        for h in sorted({r["horizon"] for r in results}):
            rs = [r for r in results if r["method"] == m and r["horizon"] == h]
            if not rs:
                continue
            after = [r["after"] for r in rs]
            out[m][str(h)] = {"mean": sum(after) / len(after), "min": min(after), "max": max(after),
                              "before": sum(r["before"] for r in rs) / len(rs), "seeds": len(rs)}
    return out


def plot(agg: dict, budget: int, path: str, xlabel: str, horizons: list[int] | None = None,
         methods: list[str] | None = None, title: str = "") -> str:
    """Held-out return after training per horizon, one line per method, its band min..max over seeds. The x axis
    has a tick only at each horizon of the plan (``horizons``); a method with no finished run at a horizon is
    marked "not run" there, never interpolated."""
    from matplotlib.figure import Figure

    horizons = sorted(set(horizons or [int(h) for by_h in agg.values() for h in by_h]))
    methods = list(methods or agg)
    fig = Figure(figsize=(7.2, 4.6))
    ax = fig.subplots()
    colors = {"es": "tab:blue", "grpo": "tab:orange", "ppo": "tab:green"}
    before, lowest = {}, min([v["min"] for by_h in agg.values() for v in by_h.values()] + [0.0])
    for k, m in enumerate(methods):
        by_h = agg.get(m, {})
        hs = sorted((h for h in by_h if int(h) in horizons), key=int)
        x = [int(h) for h in hs]
        if x:
            n = ", ".join(str(by_h[h]["seeds"]) for h in hs)
            ax.plot(x, [by_h[h]["mean"] for h in hs], "o-", color=colors.get(m),
                    label=f"{m.upper()} after training (seeds per point: {n})")
            ax.fill_between(x, [by_h[h]["min"] for h in hs], [by_h[h]["max"] for h in hs], color=colors.get(m),
                            alpha=0.15)
            for h in hs:
                before.setdefault(int(h), by_h[h]["before"])
        for h in horizons:
            if str(h) not in by_h:
                ax.plot([h], [lowest], "x", color=colors.get(m), ms=9)
                right = h == horizons[-1] and len(horizons) > 1  # the label stays inside the axes
                ax.annotate(f"{m.upper()} not run", (h, lowest), textcoords="offset points",
                            xytext=(-6 if right else 6, 6 + 11 * k), ha="right" if right else "left", fontsize=8,
                            color=colors.get(m))
    if before:
        xb = sorted(before)
        ax.plot(xb, [before[h] for h in xb], "k:", label="before training")
    ax.set_xticks(horizons)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out return (mean over held-out tasks)")
    ax.set_title(title or f"tiny agent, {budget} training episodes per run and method (band: min..max over seeds)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.12, top=0.92)
    fig.savefig(path, dpi=100)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(prog=os.environ.get("ESOPT_PROG"), description=__doc__.splitlines()[0])
    ap.add_argument("--env", default="sudoku", help="env.name of every run (any built-in or installed plugin)")
    ap.add_argument("--horizon-key", default=SUDOKU_HORIZON, help="the integer setting each horizon value sets")
    ap.add_argument("--turns-per-horizon", type=int, default=2, help="env.max_turns = this x horizon (0: unset)")
    ap.add_argument("--horizons", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--budget", type=int, default=2048, help="training episodes per run, the same for every method")
    ap.add_argument("--es-population", type=int, default=8)
    ap.add_argument("--es-episodes", type=int, default=8, help="episodes per ES member per step")
    ap.add_argument("--pg-tasks", type=int, default=8, help="GRPO/PPO tasks per step")
    ap.add_argument("--pg-generations", type=int, default=8, help="GRPO/PPO rollouts per task")
    ap.add_argument("--n-eval", type=int, default=64, help="held-out tasks per horizon")
    ap.add_argument("--task-seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="runs at once")
    ap.add_argument("--threads", type=int, help="torch threads per run (default cpu_count // jobs; 1 on a busy machine:"
                                               " oversubscribed OpenMP threads slow a small model down many times)")
    ap.add_argument("--out", default="runs/crossover")
    ap.add_argument("--report-only", action="store_true",
                    help="aggregate and plot the runs already finished under --out (the rest are listed as missing)")
    ap.add_argument("--replot", metavar="JSON", help="redraw the plot of a crossover.json (beside it); nothing runs")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            rep = json.load(f)
        key = rep.get("horizon_key", SUDOKU_HORIZON)
        xlabel = "H* (blank cells, 4x4 Sudoku)" if key == SUDOKU_HORIZON else f"{key} ({rep.get('env')})"
        print(plot(rep["success_after"], rep["budget_episodes_per_run"],
                   os.path.join(os.path.dirname(os.path.abspath(args.replot)), "crossover.png"), xlabel,
                   rep["horizons"], rep.get("methods") or list(METHODS)))
        return
    args.out = os.path.abspath(args.out)
    runs = plan(args)
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, args.jobs))
    t0 = time.perf_counter()
    results, missing = [], []
    if args.report_only:  # what the finished runs show; nothing is started
        for r in runs:
            if _summary(r["dir"]) is None:
                missing.append({k: r[k] for k in ("method", "horizon", "seed")})
                continue
            try:
                results.append(execute(r, threads))
            except RuntimeError as e:  # e.g. a run that played another number of episodes: never averaged in
                missing.append({k: r[k] for k in ("method", "horizon", "seed")} | {"invalid": str(e)})
    else:
        with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [pool.submit(execute, r, threads) for r in runs]
            for fut in tqdm(cf.as_completed(futures), total=len(futures), desc="crossover runs", file=sys.stderr):
                results.append(fut.result())
    if not results:
        raise SystemExit(f"no finished runs under {args.out}")
    results.sort(key=lambda r: (r["horizon"], r["method"], r["seed"]))
    agg = aggregate(results)
    os.makedirs(args.out, exist_ok=True)
    xlabel = "H* (blank cells, 4x4 Sudoku)" if args.horizon_key == SUDOKU_HORIZON else f"{args.horizon_key} ({args.env})"
    png = plot(agg, args.budget, os.path.join(args.out, "crossover.png"), xlabel, args.horizons, args.methods)
    report = {"budget_episodes_per_run": args.budget, "episodes_per_step": args.es_population * args.es_episodes,
              "env": args.env, "horizon_key": args.horizon_key, "horizons": args.horizons, "seeds": args.seeds,
              "methods": args.methods,
              "success_after": agg, "runs": results, "missing": missing,
              "plot": png,
              "seconds": round(time.perf_counter() - t0, 1)}
    with open(os.path.join(args.out, "crossover.json"), "w") as f:
        json.dump(report, f, indent=1)
    print_record("crossover", report)


if __name__ == "__main__":
    main()
