"""webarena_lite figures on the loopback demo site: reset/step time, memory per browser, episodes/s vs browsers.

    python tools/bench_web.py [--episodes 8] [--browsers 1 4]      # prints one JSON object

Episodes are played like the agent loop plays them (resets, then every live episode's step of a turn, through
``esopt_mp.envs.base.call_envs``: at once, one browser thread each), with a scripted correct policy instead of a
model, so the figures are the browser's and BrowserGym's cost.
Memory: the summed PSS of one open episode's browser processes (Chromium's, playwright's chat window included).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import time

from esopt_mp.profiling.record import print_record


def _browser_rss() -> int:
    import psutil

    return sum(p.memory_full_info().pss for p in psutil.Process().children(recursive=True)
               if "chrom" in p.name().lower())  # PSS: shared pages split between the processes that map them


def play(n_browsers: int, episodes: int, web) -> dict:
    from esopt_mp.envs import make
    from esopt_mp.envs.base import call_envs
    from esopt_mp.envs.web import demo

    tasks = demo.tasks(episodes)
    resets, steps, rss, rewards = [], [], [], []
    t0 = time.perf_counter()
    for a in range(0, episodes, n_browsers):
        batch = tasks[a:a + n_browsers]
        envs = [make("webarena_lite", max_turns=4, web=web) for _ in batch]
        obs, filled = {}, set()
        for i, (out, err, secs) in enumerate(call_envs([(e, "reset", t) for e, t in zip(envs, batch)])):
            if err is not None:
                raise err
            obs[i] = out[0][-1]["content"]
            resets.append(secs)
        rss.append(_browser_rss() / len(batch))
        live = list(range(len(batch)))
        while live:
            nxt, replies = [], {}
            for i in live:
                task = batch[i]
                if task["gym_id"].endswith(".code"):
                    reply = f'send_msg_to_user("{demo.code_of(task["seed"])}")'
                elif i in filled:
                    reply = 'click("%s")' % re.search(r"\[(\w+)\] button .Submit.", obs[i]).group(1)
                else:
                    box = re.search(r"\[(\w+)\] textbox 'Name'", obs[i]).group(1)
                    reply = f'fill("{box}", "{demo.NAMES[task["seed"] % len(demo.NAMES)]}")'
                    filled.add(i)
                replies[i] = reply
            for i, (out, err, secs) in zip(live, call_envs([(envs[i], "step", replies[i]) for i in live])):
                if err is not None:
                    raise err
                msgs, r, term, trunc, _ = out
                steps.append(secs)
                if term or trunc:
                    rewards.append(r)
                else:
                    obs[i] = msgs[-1]["content"]
                    nxt.append(i)
            live = nxt
        for env in envs:
            env.close()
    wall = time.perf_counter() - t0
    return {"browsers": n_browsers, "episodes": episodes, "episodes_per_s": episodes / wall,
            "mean_return": sum(rewards) / len(rewards), "reset_s_median": statistics.median(resets),
            "step_s_median": statistics.median(steps), "pss_mb_per_episode": statistics.mean(rss) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(prog=os.environ.get("ESOPT_PROG"), description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--browsers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--settle", type=float, default=0.0, help="env.webarena_lite.settle_s (BrowserGym's pre_observation_delay)")
    args = ap.parse_args()
    import logging

    logging.getLogger("browsergym").setLevel(logging.ERROR)
    from esopt_mp.envs.web.config import WebConfig

    web = WebConfig(settle_s=args.settle)
    runs = [play(n, args.episodes, web) for n in args.browsers]
    print_record("web", {"site": "demo (loopback)", "settle_s": args.settle, "runs": runs})


if __name__ == "__main__":
    main()
