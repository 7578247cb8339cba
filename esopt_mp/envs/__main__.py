"""Environments from the command line: list them, show one's section, check one before training on it.

    python -m esopt_mp.envs list                                  # built-ins and installed plugins
    python -m esopt_mp.envs show reasoning_gym                    # its section's keys and defaults
    python -m esopt_mp.envs check my_env difficulty=3 --reply "42"  # tasks, reset, steps: what training will do

``check`` builds the section from ``key=value`` pairs (YAML values) as ``env.<name>.<key>=value`` would, draws
two tasks of each split, resets an episode and plays it with the ``--reply`` texts (default: a few hostile
replies: empty, binary, very long) until it ends, and prints one JSON object: the tasks, the opening messages, each
step's reward and flags, the return, and any failure in the terms the trainer would count it (``model``: the step
raised; ``infra``: an ``InfraError`` or a failed reset). Exit status 0 when nothing failed, 1 otherwise, 2 on a bad
name or section.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

HOSTILE = ("", "\x00\xff<tool_call>{" * 20, "x" * 20000, "<answer></answer>" * 50)


def _section(spec, pairs: list[str], name: str):
    import yaml

    from esopt_mp.envs.registry import build_section

    data = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise ValueError(f"expected key=value, got {pair!r}")
        data[key.removeprefix(f"env.{name}.")] = yaml.safe_load(value)
    section = build_section(spec, data, f"env.{name}")
    spec.validate(section, _Generic(), f"env.{name}")
    return section


class _Generic:
    """The shared ``env`` settings at their defaults, for an environment's cross-checks."""

    def __init__(self):
        from esopt_mp.config import EnvConfig

        self.__dict__.update({k: v for k, v in vars(EnvConfig()).items() if k != "sections"})


def check(name: str, pairs: list[str], replies: list[str], max_turns: int) -> dict:
    from esopt_mp.envs.base import InfraError, failure_return, returns_sum
    from esopt_mp.envs.registry import load_spec

    spec = load_spec(name)
    section = _section(spec, pairs, name)
    out = {"name": name, "section": spec.to_dict(section), "failure": None}
    train, held = spec.tasks(section, "train", 2, 0), spec.tasks(section, "eval", 2, 1)
    out["tasks"] = {"train": train, "eval": held}
    json.dumps(out["tasks"])  # tasks must be JSON (trajectories, resumes)
    env = spec.build(section, max_turns=max_turns, sandbox=None)
    try:
        try:
            msgs, info = env.reset(train[0])
        except Exception as e:  # noqa: BLE001 - what the trainer would count
            out["failure"] = {"kind": "infra", "at": "reset", "error": f"{type(e).__name__}: {e}"}
            return out
        out["opening"] = msgs
        total, rewards, turn = 0.0, [], 0
        for turn in range(max_turns):
            reply = replies[turn % len(replies)]
            try:
                msgs, reward, term, trunc, info = env.step(reply)
            except Exception as e:  # noqa: BLE001
                kind = "infra" if isinstance(e, InfraError) else "model"
                out["failure"] = {"kind": kind, "at": f"step {turn + 1}", "error": f"{type(e).__name__}: {e}",
                                  "scores": None if kind == "infra" else failure_return(env)}
                break
            rewards.append(float(reward))
            total += float(reward)
            if term or trunc:
                break
        out.update(rewards=rewards, turns=len(rewards), feedback=msgs[-1]["content"][:500] if msgs else None,
                   ret=(total if returns_sum(env) else rewards[-1]) if rewards else None,
                   returns="sum" if returns_sum(env) else "last")
        if out["ret"] is not None and not math.isfinite(out["ret"]):
            out["failure"] = {"kind": "model", "at": "return", "error": f"return {out['ret']} is not finite"}
    finally:
        getattr(env, "close", lambda: None)()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m esopt_mp.envs", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="built-in environments and installed plugins")
    show = sub.add_parser("show", help="an environment's section: keys and defaults")
    show.add_argument("name")
    chk = sub.add_parser("check", help="tasks, a reset and an episode of replies, as training plays them")
    chk.add_argument("name")
    chk.add_argument("pairs", nargs="*", help="section keys: key=value (YAML values)")
    chk.add_argument("--reply", action="append", default=[], help="a reply to play (repeat for several turns)")
    chk.add_argument("--max-turns", type=int, default=4)
    args = ap.parse_args(argv)
    from esopt_mp.envs.registry import EnvNotFound, describe, names

    try:
        if args.cmd == "list":
            builtin, plugins = names()
            print(json.dumps({"builtin": builtin, "plugins": plugins}))
            return 0
        if args.cmd == "show":
            print(json.dumps(describe(args.name), indent=1, default=str))
            return 0
        out = check(args.name, args.pairs, args.reply or list(HOSTILE), args.max_turns)
    except (EnvNotFound, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=1, default=str))
    return 1 if out["failure"] else 0


if __name__ == "__main__":
    sys.exit(main())
