"""``esopt``: one command for what users run, as ``vllm serve`` or ``tune run`` are.

    esopt train [Hydra overrides]        # launch/train.py (torchrun, srun, deepspeed and mpirun still launch it)
    esopt replay --run-dir R --out D     # rebuild a run's weights from its base model and ledger
    esopt export --run-dir R --out D     # a run's newest checkpoint plus the ledger tail, as a plain HF directory
    esopt envs list|show|check ...       # the environments, and a check of one before training
    esopt bench [--quick]                # the benchmark suite (JSON)
    esopt bench NAME [...]               # one benchmark: learning, noise, comm, rollout, ... (esopt bench list)

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
    "bench": ("tools/bench.py", "the benchmark suite, or one benchmark: esopt bench NAME (esopt bench list)"),
}
# esopt bench NAME -> (its script, one line of help); each prints one record (esopt_mp.profiling.record)
BENCHMARKS = {
    "learning": ("tools/bench_learning.py", "ES, GRPO and PPO at an equal episode budget, held-out curves"),
    "noise": ("tools/bench_noise.py", "noise generator and fused update vs torch.randn and a copy"),
    "throughput": ("tools/bench_throughput.py", "ES step tokens/s vs the same rollouts alone"),
    "members": ("tools/bench_members.py", "a low-rank ES step with all members in one batch vs batch inference"),
    "schedule": ("tools/bench_schedule.py", "static vs dynamic member scheduling on a slow site"),
    "comm": ("tools/bench_comm.py", "bytes an ES step sends vs a data-parallel gradient all-reduce"),
    "rollout": ("tools/bench_rollout.py", "the engine's tokens/s vs model.generate"),
    "endpoint": ("tools/bench_endpoint.py", "tokens/s through the OpenAI-compatible endpoint vs in process"),
    "engines": ("tools/bench_engines.py", "the hf and vLLM engines side by side"),
    "decode": ("tools/bench_decode.py", "decode tokens/s against the memory-bandwidth bound of the weights"),
    "checkpoint": ("tools/bench_checkpoint.py", "checkpoint save and load speed"),
    "export": ("tools/bench_export.py", "peak memory of an export"),
    "threads": ("tools/bench_threads.py", "ES step time beside a busy process, per OpenMP wait policy"),
    "web": ("tools/bench_web.py", "browser environment step latency on the loopback demo site"),
    "crossover": ("tools/crossover.py", "ES vs GRPO as the horizon grows, in miniature"),
}
# old spelling -> new, kept one release with a one-line notice
RENAMED = {"bench-learning": ["bench", "learning"]}


def _listing(entries: dict) -> str:
    """``name  help`` lines, names aligned: the commands in :func:`usage`, the benchmarks in ``esopt bench list``."""
    width = max(map(len, entries))
    return "".join(f"  {n:<{width}}  {h}\n" for n, (_, h) in entries.items())


def usage() -> str:
    return ("usage: esopt <command> [options]\n\ncommands:\n" + _listing(VERBS)
            + "\n'esopt <command> --help' shows a command's options.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in RENAMED:
        new = RENAMED[argv[0]]
        print(f"note: 'esopt {argv[0]}' is now 'esopt {' '.join(new)}' (same options); this spelling goes in the "
              f"next release", file=sys.stderr)
        argv = [*new, *argv[1:]]
    verb, rest = argv[0], argv[1:]
    if verb == "bench" and rest and rest[0] == "list":
        print("esopt bench runs the suite; esopt bench NAME one benchmark:\n" + _listing(BENCHMARKS), end="")
        return 0
    if verb == "bench" and rest and not rest[0].startswith("-"):  # one benchmark by name; options: the suite
        if rest[0] not in BENCHMARKS:
            from esopt_mp.typed import did_you_mean

            print(f"esopt bench: unknown benchmark {rest[0]!r}{did_you_mean(rest[0], BENCHMARKS)}; benchmarks: "
                  f"{', '.join(BENCHMARKS)} (or no name: the suite)", file=sys.stderr)
            return 2
        return run_script(f"bench {rest[0]}", BENCHMARKS[rest[0]][0], rest[1:])
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
    return run_script(verb, script, rest)


def run_script(verb: str, script: str, rest: list[str]) -> int:
    """Run ``script`` of the checkout as itself with ``rest`` as its options; its exit status."""
    path = os.path.join(ROOT, script)
    if not os.path.isfile(path):
        print(f"esopt {verb}: {script} is not beside the installed package ({ROOT}): 'esopt' runs from a source "
              f"checkout installed with pip install -e .", file=sys.stderr)
        return 2
    saved_argv, saved_prog = sys.argv, os.environ.get("ESOPT_PROG")
    sys.argv = [path, *rest]  # runpy sets argv[0] and __main__ as a script run sees them, and restores both
    os.environ["ESOPT_PROG"] = f"esopt {verb}"  # a benchmark's record names the command as the user typed it
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:  # the script's own exit: its status, its message (a string) on stderr
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved_argv
        if saved_prog is None:
            os.environ.pop("ESOPT_PROG", None)
        else:
            os.environ["ESOPT_PROG"] = saved_prog
    return 0


if __name__ == "__main__":
    sys.exit(main())
