"""ES step time on a shared machine: with one competing busy process over alone, per OpenMP wait policy.

    python tools/bench_threads.py                       # SmolLM2-135M-Instruct, the arith task, default threads
    python tools/bench_threads.py --policies PASSIVE ACTIVE --steps 3

Each case is ``launch/train.py`` in its own process (the ``smollm2_arith`` profile at a small population), with
the thread count the launcher picks by default (this node's cores), alone or beside one process that spins on a
core for the whole run. A case's step time is the mean ``step_s`` of its steps after the first (the first also
compiles the noise kernel). Prints one JSON object: each case's step time and, per policy,
``busy_over_alone``. Run it on an otherwise idle machine: "alone" means alone.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from esopt_mp.profiling.record import print_record

SPIN = "import time\nt = time.time()\nwhile time.time() - t < 3600:\n    pass\n"


def case(policy: str, busy: bool, steps: int, overrides: list[str]) -> dict:
    from esopt_mp.runfiles import read_jsonl

    run_dir = tempfile.mkdtemp(prefix=f"esopt_threads_{policy}_{int(busy)}_")
    argv = ["+experiment=smollm2_arith", "run.checkpoint_every=0", "run.trajectories=false", "run.eval_every=0",
            "env.n_eval=8", "es.population=2", "env.episodes_per_step=4", "engine.max_new_tokens=32",
            f"es.steps={steps}", f"run.dir={run_dir}", *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "ESOPT_THREADS")}
    env["OMP_WAIT_POLICY"] = policy
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
    try:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "launch/train.py", *argv], cwd=ROOT, env=env, capture_output=True,
                              text=True)
        wall = time.perf_counter() - t0
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    if proc.returncode != 0:
        raise SystemExit(f"{policy} busy={busy}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "step_s" in r]
    later = [r["step_s"] for r in rows[1:]] or [rows[0]["step_s"]]
    threads = next((l.split("CPU threads per rank: ", 1)[1] for l in proc.stderr.splitlines()
                    if "CPU threads per rank" in l), "?")
    return {"policy": policy, "busy": busy, "step_s": sum(later) / len(later), "steps_s": [r["step_s"] for r in rows],
            "wall_s": wall, "threads": threads}


def main() -> None:
    ap = argparse.ArgumentParser(prog=os.environ.get("ESOPT_PROG"), description=__doc__.splitlines()[0])
    ap.add_argument("--policies", nargs="+", default=["PASSIVE", "ACTIVE"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="each case this many times, in ABBA order (a slow "
                    "start or a drifting machine weighs on every case alike); a case's figure is its mean")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every case")
    args = ap.parse_args()
    order = [(policy, busy) for policy in args.policies for busy in (False, True)]
    cases = []
    for r in range(args.rounds):
        for policy, busy in (order if r % 2 == 0 else order[::-1]):
            c = case(policy, busy, args.steps, args.overrides)
            print(f"[bench_threads] round {r + 1}: {policy} busy={busy}: {c['step_s']:.1f} s/step", file=sys.stderr)
            cases.append({**c, "round": r + 1})
    mean = {}
    for policy, busy in order:
        mine = [c["step_s"] for c in cases if (c["policy"], c["busy"]) == (policy, busy)]
        mean[f"{policy}{'_busy' if busy else '_alone'}"] = sum(mine) / len(mine)
    ratios = {policy: mean[f"{policy}_busy"] / mean[f"{policy}_alone"] for policy in args.policies}
    print_record("threads", {"cases": cases, "step_s": mean, "busy_over_alone": ratios,
                             "passive_over_active_alone": (mean["PASSIVE_alone"] / mean["ACTIVE_alone"]
                                                           if {"PASSIVE", "ACTIVE"} <= set(args.policies) else None)})


if __name__ == "__main__":
    main()
