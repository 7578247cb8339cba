"""``esopt``: one command for what users run, as ``vllm serve`` or ``tune run`` are.

    esopt train [Hydra overrides]        # launch/train.py (torchrun, srun, deepspeed and mpirun still launch it)
    esopt replay --run-dir R --out D     # rebuild a run's weights from its base model and ledger
    esopt export --run-dir R --out D     # a run's newest checkpoint plus the ledger tail, as a plain HF directory
    esopt envs list|show|check ...       # the environments, and a check of one before training
    esopt bench [--quick]                # the benchmark suite (JSON)
    esopt bench-learning [...]           # ES, GRPO and PPO at an equal episode budget on a (model, task) pair

Each verb runs the script it names with the rest of the command line, in this process and as that script (its
``sys.argv[0]``), so its options, output, exit status and any re-execution of itself are the script's. The
scripts live in the source checkout beside ``esopt_mp/`` (``launch/``, ``tools/``, ``configs/``): the command is
for an editable install, and says so in one line elsewhere.
"""
from __future__ import annotations

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# verb -> (the script under the checkout, one line of help)
VERBS = {
    "train": ("launch/train.py", "train (ES, or algo=grpo|ppo); Hydra overrides, --help for the main keys"),
    "replay": ("tools/replay.py", "rebuild a run's weights from its base model and ledger"),
    "export": ("tools/export_hf.py", "write a run's weights as a plain Hugging Face directory"),
    "envs": (None, "list, show and check environments"),
    "bench": ("tools/bench.py", "the benchmark suite: noise, ES overhead, throughput, comm, memory, rollout"),
    "bench-learning": ("tools/bench_learning.py", "ES, GRPO and PPO at an equal episode budget, held-out curves"),
}


def usage() -> str:
    width = max(map(len, VERBS))
    return ("usage: esopt <command> [options]\n\ncommands:\n"
            + "".join(f"  {v:<{width}}  {h}\n" for v, (_, h) in VERBS.items())
            + "\n'esopt <command> --help' shows a command's options.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        from esopt_mp.typed import did_you_mean

        print(f"esopt: unknown command {verb!r}{did_you_mean(verb, VERBS)}; commands: {', '.join(VERBS)}",
              file=sys.stderr)
        return 2
    script = VERBS[verb][0]
    if script is None:  # envs: a module of the package
        from esopt_mp.envs.__main__ import main as envs_main

        return envs_main(rest)
    path = os.path.join(ROOT, script)
    if not os.path.isfile(path):
        print(f"esopt {verb}: {script} is not beside the installed package ({ROOT}): 'esopt' runs from a source "
              f"checkout installed with pip install -e .", file=sys.stderr)
        return 2
    saved_argv = sys.argv
    sys.argv = [path, *rest]  # runpy sets argv[0] and __main__ as a script run sees them, and restores both
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:  # the script's own exit: its status, its message (a string) on stderr
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved_argv
    return 0


if __name__ == "__main__":
    sys.exit(main())
