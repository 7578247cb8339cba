"""One record for every benchmark, so that figures from different machines and days can be set side by side:

    {"benchmark": NAME, "command": "esopt bench NAME ...", "machine": {...}, "versions": {...}, "figures": {...}}

``machine`` is where it ran (cores usable, torch's threads, the device, the checkout's commit), ``versions`` the
libraries that shape the figures (:func:`esopt_mp.profiling.versions.library_versions`), ``figures`` the
benchmark's own measurements.
"""
from __future__ import annotations

import json
import os
import sys

from esopt_mp.profiling.versions import library_versions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git_commit() -> str | None:
    """The checkout's commit, read from ``.git`` (no git process), when the package runs from a git checkout."""
    git = os.path.join(ROOT, ".git")
    try:
        with open(os.path.join(git, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref: "):
            return head or None  # a detached HEAD holds the commit itself
        ref = head[5:]
        try:
            with open(os.path.join(git, ref)) as f:
                return f.read().strip() or None
        except FileNotFoundError:  # packed by git gc: "<sha> <ref>" lines
            with open(os.path.join(git, "packed-refs")) as f:
                return next((line.split()[0] for line in f if line.rstrip().endswith(" " + ref)), None)
    except OSError:  # not a checkout (an installed package), or a worktree's .git file
        return None


def machine() -> dict:
    """Where a benchmark ran: cores (all, and usable by this process), torch's threads, the device, the commit."""
    torch = sys.modules.get("torch")  # a benchmark that never imported torch is not made to
    cuda = torch is not None and torch.cuda.is_available()
    return {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads() if torch is not None else None,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu", "git_commit": git_commit(),
            "loopback_isolated": os.environ.get("ESOPT_BENCH_NETNS") == "1"}


def command_line(argv: list[str] | None = None) -> str:
    """How the benchmark was started, as a user would type it again."""
    argv = list(sys.argv if argv is None else argv)
    prog = os.environ.get("ESOPT_PROG")  # set by the `esopt` command: its spelling, not the script's path
    if prog:
        return " ".join([prog, *argv[1:]])
    return " ".join(["python", os.path.relpath(argv[0], ROOT) if argv and argv[0] else "-", *argv[1:]])


def bench_record(name: str, figures: dict, argv: list[str] | None = None) -> dict:
    """The record of benchmark ``name`` with ``figures``."""
    return {"benchmark": name, "command": command_line(argv), "machine": machine(), "versions": library_versions(),
            "figures": figures}


def print_record(name: str, figures: dict) -> dict:
    """Print the record as one JSON line on stdout (what every benchmark ends with) and return it."""
    rec = bench_record(name, figures)
    print(json.dumps(rec), flush=True)
    return rec
