"""Static vs dynamic member scheduling under heavy-tailed episode times: ES step time at dp=2 and dp=4.

A synthetic environment stands for a slow site: each episode waits a log-normal time (median ``--median`` s,
log-sd ``--sigma``) drawn from the task and the model's reply, so both schedules meet exactly the same delays, then
scores the reply. The tiny agent plays it through the real trainer in a spawned gloo world; only which dp group
runs which member differs (``parallel.schedule``). The waits sleep, so the ranks hardly compete for the cores.

Usage: python tools/bench_schedule.py [--dps 2,4] [--steps 3] [--population 16] [--median 0.5]
                                     [--sigma 1.5]   (prints one JSON object)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time

from esopt_mp.profiling.record import print_record


class SlowSite:
    """One turn: wait a log-normal time keyed by (task, reply), then score the reply's length (varied returns)."""

    max_turns = 1
    failure_return = 0.0
    waits: list = []  # this process's waits, for the report

    median = 0.5  # seconds; the warm-up sets 0

    def __init__(self, median: float, sigma: float):
        self.sigma = sigma

    def reset(self, task):
        self.task = task
        return [{"role": "user", "content": "Say something."}], {}

    def step(self, text):
        key = hashlib.blake2b(f"{self.task.get('id')}|{text}".encode(), digest_size=8).digest()
        rng = random.Random(int.from_bytes(key, "little"))
        wait = self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        SlowSite.waits.append(wait)
        time.sleep(wait)
        return [], (len(text) % 7) / 7.0, True, False, {}


def worker(rank: int, world: int, out_dir: str, steps: int, population: int, median: float, sigma: float,
           episodes: int):
    from esopt_mp.agent import episodes as player_module
    from esopt_mp.config import build_config
    from esopt_mp.parallel import discover, init_distributed
    from esopt_mp.trainer import ESTrainer

    SlowSite.median = median
    player_module.EpisodePlayer.make_env = lambda self, max_turns: SlowSite(median, sigma)
    dims = init_distributed(discover(), world, 1)
    result = {}
    warm_up = True  # the engine's first rollouts (kernels, caches) are paid before either schedule is timed
    for schedule in ("static", "dynamic"):
        cfg = build_config({
            "run": {"dir": os.path.join(out_dir, schedule), "trajectories": False, "seed": 11},
            "model": {"path": "builtin:tiny_agent"}, "objective": {"name": "agent"},
            "parallel": {"dp": world, "tp": 1, "schedule": schedule},
            # a large sigma: every member replies differently, so members wait different times (a small sigma
            # leaves the tiny agent's replies, hence the waits, the same for all)
            "es": {"population": population, "steps": steps, "noise_backend": "eager",
                   "sigma": {"kind": "constant", "start": 1.0, "end": 1.0}},
            "env": {"name": "sudoku", "n_train": 16, "n_eval": 2, "episodes_per_step": episodes, "max_turns": 1},
            "engine": {"max_new_tokens": 8},
        }, world)
        trainer = ESTrainer(cfg, dims)
        if warm_up:
            warm_up = False
            from esopt_mp.core.types import Member

            SlowSite.median = 0.0
            trainer.objective.evaluate_member(Member(0, 0, 1, 1, 0))
            trainer.objective.take_failures(), trainer.objective.take_retried()
            SlowSite.median = median
        SlowSite.waits = []
        try:
            recs = [trainer.step(t) for t in range(steps)]
            ledger = trainer.ledger.read()
            waits = sorted(w for part in dims.comm.all_gather_object(SlowSite.waits) for w in part)
        finally:
            trainer.close()
        result[schedule] = {"step_s": [r["step_s"] for r in recs],
                            "returns": [e["returns"] for e in ledger], "waits_s": waits}
    if rank == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)


def run(dps: list[int], steps: int, population: int, median: float, sigma: float, episodes: int) -> dict:
    from esopt_mp.parallel.local_world import run_world

    out = {"env": {"episode_wait": "log-normal", "median_s": median, "log_sd": sigma, "episodes_per_member": episodes},
           "population": population, "steps": steps, "layouts": {}, "headline": {}}
    for dp in dps:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            run_world(dp, worker, tmp, steps, population, median, sigma, episodes, timeout=1800)
            with open(os.path.join(tmp, "result.json")) as f:
                res = json.load(f)
        st, dy = res["static"]["step_s"], res["dynamic"]["step_s"]
        out["layouts"][f"dp{dp}"] = {
            "static_step_s": st, "dynamic_step_s": dy,
            "static_mean_s": statistics.fmean(st), "dynamic_mean_s": statistics.fmean(dy),
            "same_returns": res["static"]["returns"] == res["dynamic"]["returns"],
            "same_waits": res["static"]["waits_s"] == res["dynamic"]["waits_s"],
            "waits_s": {"total": sum(res["static"]["waits_s"]), "max": max(res["static"]["waits_s"]),
                        "median": statistics.median(res["static"]["waits_s"])},
            "wall_s": time.perf_counter() - t0}
        lay = out["layouts"][f"dp{dp}"]
        if not (lay["same_returns"] and lay["same_waits"]):  # not the same work: no comparison
            lay["invalid"] = "the two schedules did not meet the same waits and returns"
            continue
        out["headline"][f"static_over_dynamic_dp{dp}"] = statistics.fmean(st) / statistics.fmean(dy)
        print(f"bench_schedule: dp={dp}: static {statistics.fmean(st):.2f} s/step, dynamic "
              f"{statistics.fmean(dy):.2f} s/step", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog=os.environ.get("ESOPT_PROG"), description=__doc__.splitlines()[0])
    ap.add_argument("--dps", default="2,4", help="data-parallel sizes, comma-separated")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--population", type=int, default=16)
    ap.add_argument("--median", type=float, default=0.5, help="median episode wait, seconds")
    ap.add_argument("--sigma", type=float, default=1.5, help="log-sd of the episode wait")
    ap.add_argument("--episodes", type=int, default=1, help="episodes per member and step")
    a = ap.parse_args()
    print_record("schedule", run([int(x) for x in a.dps.split(",")], a.steps, a.population, a.median, a.sigma,
                                 a.episodes))


if __name__ == "__main__":
    main()
