"""Does ES improve the agent? Runs the embedded default with several seeds; prints one JSON object.

    python tools/bench_learning.py                 # 3 seeds of `python launch/train.py`
    python tools/bench_learning.py --seeds 0 1 --  es.steps=10   # extra Hydra overrides after --

Each seed runs as its own process in its own run dir (run.seed differs, everything else
is the default); held-out success before and after comes from each run's summary.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--runs", help="where the run dirs go (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for launch/train.py")
    args = ap.parse_args()
    base = args.runs or tempfile.mkdtemp(prefix="esopt_learning_")
    runs = []
    for seed in args.seeds:
        run_dir = os.path.join(base, f"seed{seed}")
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "launch/train.py", f"run.seed={seed}", f"run.dir={run_dir}",
                               *args.overrides], cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-3000:])
            raise SystemExit(f"seed {seed} failed")
        s = json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])
        runs.append({"seed": seed, "before": s["eval_before"], "after": s["eval_after"],
                     "delta": s["eval_after"] - s["eval_before"], "seconds": time.perf_counter() - t})
    mean = lambda k: sum(r[k] for r in runs) / len(runs)  # noqa: E731
    print(json.dumps({"runs": runs, "mean_before": mean("before"), "mean_after": mean("after"),
                      "mean_delta": mean("delta"), "overrides": args.overrides, "run_root": base}))


if __name__ == "__main__":
    main()
