"""WebArena-Lite task sets and the site preflight, from the command line (:mod:`esopt_mp.envs.web.tasks`).

    python tools/webarena_tasks.py [--split train] [--ids 4 15] [--answer-only]      # the task set's counts
    python tools/webarena_tasks.py --preflight [--split train] [--ids 4 15]          # + the stack and its sites
    python tools/webarena_tasks.py --preflight -- +experiment=webarena_27b [overrides]  # the run's own start check

Prints one JSON object; exit status 1 when something is missing (named in ``error``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from esopt_mp.envs.web.tasks import (judge_preflight, load_split, preflight, select,
                                     startup_check)


def run_env_config(overrides: list[str]):
    """The ``env`` section the trainer would get from these Hydra overrides (the repository's configs)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from esopt_mp.config import build_config, open_sections

    configs = os.path.join(ROOT, "configs")
    try:
        with initialize_config_dir(config_dir=configs, version_base="1.3"):
            data = OmegaConf.to_container(compose("config", overrides=open_sections(list(overrides))), resolve=True)
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors: one line, as the trainer would fail
        raise ValueError(f"config overrides {overrides}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    return build_config(data).env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="WebArena-Lite task sets and the site preflight")
    ap.add_argument("--split", default="all", choices=("all", "train", "heldout"))
    ap.add_argument("--ids", type=int, nargs="*", default=[])
    ap.add_argument("--answer-only", action="store_true")
    ap.add_argument("--preflight", action="store_true", help="check the browser stack and the sites the tasks need")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("overrides", nargs="*", help="after --: the run's Hydra overrides; its env.webarena_lite task set "
                    "and settings replace --split/--ids/--answer-only/--timeout, and the trainer's start check runs")
    a = ap.parse_args(argv)
    if a.overrides:
        try:
            env = run_env_config(a.overrides)
            train, held = load_split(env, env.section)
            startup_check(env, env.section, reset=False)  # the trainer's own check (stack, sites, judge), without the reset
        except (RuntimeError, ValueError) as e:  # WebStackMissing and ConfigError are among them
            print(json.dumps({"error": str(e)}))
            return 1
        print(json.dumps({"train": len(train), "heldout": len(held), "suite": env.webarena_lite.suite}))
        return 0
    tasks, counts = select(a.ids, a.split, a.answer_only)
    out = {"counts": counts}
    if a.preflight:
        from esopt_mp.envs.web.stack import check

        try:
            out["stack"] = check()
            out["sites"] = preflight({s for t in tasks for s in t["sites"]}, a.timeout)
            if any(t["judged"] for t in tasks):
                out["judge_models"] = judge_preflight(a.timeout)
        except RuntimeError as e:  # WebStackMissing is one
            print(json.dumps({**out, "error": str(e)}))
            return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
