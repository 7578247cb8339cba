"""``esopt``: one command for what users run, as ``vllm serve`` or ``tune run`` are.

    esopt train [Hydra overrides]        # launch/train.py (torchrun, srun, deepspeed and mpirun still launch it)
    esopt replay --run-dir R --out D     # rebuild a run's weights from its base model and ledger
    esopt export --run-dir R --out D     # a run's newest checkpoint plus the ledger tail, as a plain HF directory
    esopt envs list|show|check ...       # the environments, and a check of one before training
    esopt bench [--quick]                # the benchmark suite (JSON)
    esopt bench-learning [...]           # ES, GRPO and PPO at an equal episode budget on a (model, task) pair

``replay``, ``export`` and ``envs`` are functions of the package. ``train`` and the benchmarks run the script they
name with the rest of the command line, in this process and as that script (its ``sys.argv[0]``), so its options,
output, exit status and any re-execution of itself are the script's. Those scripts live in the source checkout
beside ``esopt_mp/`` (``launch/``, ``tools/``, ``configs/``): they need an editable install, and say so in one
line elsewhere.
"""
from __future__ import annotations

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# verb -> (a script under the checkout, or "module:function" of the package; one line of help)
VERBS = {
    "train": ("launch/train.py", "train (ES, or algo=grpo|ppo); Hydra overrides, --help for the main keys"),
    "replay": ("esopt_mp.replay:main", "rebuild a run's weights from its base model and ledger"),
    "export": ("esopt_mp.replay:main_export", "write a run's weights as a plain Hugging Face directory"),
    "envs": ("esopt_mp.envs.__main__:main", "list, show and check environments"),
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
    if ":" in script:  # a function of the package
        import importlib

        module, _, func = script.partition(":")
        fn = getattr(importlib.import_module(module), func)
        try:
            return fn(rest, prog=f"esopt {verb}")
        except SystemExit as e:  # argparse's --help and usage errors
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
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
