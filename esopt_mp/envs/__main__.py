"""Environments from the command line: list them, show one's section, check one before training on it.

    python -m esopt_mp.envs list                                  # built-ins, installed plugins, name clashes
    python -m esopt_mp.envs show reasoning_gym                    # its section's keys and defaults
    python -m esopt_mp.envs check my_env difficulty=3 --reply "42"  # tasks, reset, steps: what training will do

``check`` builds the section from ``key=value`` pairs (YAML values; ``a.b=v`` for a key of a mapping) over the
environment's own defaults (not an experiment profile's), as ``env.<name>.<key>=value`` would; runs the
environment's start-up check; draws the tasks of both splits as training would (``--n-train`` / ``--n-eval``,
held-out tasks equal to a training task dropped); resets an episode and plays it with the ``--reply`` texts
(default: a few hostile replies: empty, binary, very long) until it ends; and prints one JSON object: the tasks,
the opening messages, each step's reward, the return, and any failure in the terms the trainer would count it
(``startup``: the check, the tasks or the constructor failed; ``model``: the step raised or its reward is not
finite; ``infra``: an ``InfraError`` or a failed reset). Exit status 0 when nothing failed, 1 otherwise, 2 on a
bad name or section.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

HOSTILE = ("", "\x00\xff<tool_call>{" * 20, "x" * 20000, "<answer></answer>" * 50)


def _section(spec, pairs: list[str], name: str):
    import yaml

    from esopt_mp.envs.config import EnvConfig
    from esopt_mp.envs.registry import build_section

    data: dict = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise ValueError(f"expected key=value, got {pair!r}")
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ValueError(f"{key}: not a YAML value: {str(e).splitlines()[0]}") from None
        *outer, last = key.removeprefix(f"env.{name}.").split(".")
        node = data
        for part in outer:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{key}: {part} is not a mapping")
        node[last] = value
    section = build_section(spec, data, f"env.{name}")
    spec.validate(section, EnvConfig(name=name), f"env.{name}")
    return section


def check(name: str, pairs: list[str], replies: list[str], max_turns: int, n_train: int = 2, n_eval: int = 2) -> dict:
    from esopt_mp.envs.config import EnvConfig
    from esopt_mp.envs.base import InfraError, failure_return, returns_sum
    from esopt_mp.envs.registry import load_spec

    spec = load_spec(name)
    section = _section(spec, pairs, name)
    out = {"name": name, "section": spec.to_dict(section), "failure": None}
    generic = EnvConfig(name=name, n_train=n_train, n_eval=n_eval, episodes_per_step=1, max_turns=max_turns)
    try:
        spec.check(section, generic, first=True)
    except Exception as e:  # noqa: BLE001 - what training's start-up would refuse
        out["failure"] = {"kind": "startup", "at": "check", "error": f"{type(e).__name__}: {e}"}
        return out
    try:
        train, held = spec.splits(generic, section)
        out["tasks"] = {"train": train, "eval": held}
        json.dumps(out["tasks"], allow_nan=False)  # tasks must be JSON (trajectories, resumes)
    except Exception as e:  # noqa: BLE001 - too few tasks, tasks not JSON, a task source that raised
        out["failure"] = {"kind": "startup", "at": "tasks", "error": f"{type(e).__name__}: {e}"}
        return out
    try:
        env = spec.build(section, max_turns=max_turns, sandbox=None)
    except Exception as e:  # noqa: BLE001 - the environment's constructor: nothing could be played
        out["failure"] = {"kind": "startup", "at": "build", "error": f"{type(e).__name__}: {e}"}
        return out
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
            if not math.isfinite(rewards[-1]):
                out["failure"] = {"kind": "model", "at": f"step {turn + 1}", "error": f"reward {reward} is not "
                                  "finite", "scores": failure_return(env)}
                break
            if term or trunc:
                break
        out.update(rewards=rewards, turns=len(rewards), feedback=msgs[-1]["content"][:500] if msgs else None,
                   ret=(total if returns_sum(env) else rewards[-1]) if rewards else None,
                   returns="sum" if returns_sum(env) else "last")
    finally:
        getattr(env, "close", lambda: None)()
    return out


def main(argv=None, prog: str = "python -m esopt_mp.envs") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", metavar="{list,show,check}")
    sub.add_parser("list", help="built-in environments and installed plugins")
    show = sub.add_parser("show", help="an environment's section: keys and defaults")
    show.add_argument("name")
    chk = sub.add_parser("check", help="tasks, a reset and an episode of replies, as training plays them")
    chk.add_argument("name")
    chk.add_argument("pairs", nargs="*", help="section keys: key=value (YAML values)")
    chk.add_argument("--reply", action="append", default=[], help="a reply to play (repeat for several turns)")
    chk.add_argument("--max-turns", type=int, default=4)
    chk.add_argument("--n-train", type=int, default=2, help="training tasks drawn (env.n_train)")
    chk.add_argument("--n-eval", type=int, default=2, help="held-out tasks kept (env.n_eval)")
    args = ap.parse_args(argv)
    if args.cmd is None:  # no command: what the commands are, as --help says it
        ap.print_help()
        return 0
    from esopt_mp.envs.registry import EnvNotFound, describe, duplicates, names, shadowed

    try:
        if args.cmd == "list":
            builtin, plugins = names()
            print(json.dumps({"builtin": builtin, "plugins": plugins, "shadowed": shadowed(),
                              "duplicates": duplicates()}))
            return 0
        if args.cmd == "show":
            print(json.dumps(describe(args.name), indent=1, default=str))
            return 0
        out = check(args.name, args.pairs, args.reply or list(HOSTILE), args.max_turns, args.n_train, args.n_eval)
    except (EnvNotFound, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=1, default=str))
    return 1 if out["failure"] else 0


if __name__ == "__main__":
    sys.exit(main())
