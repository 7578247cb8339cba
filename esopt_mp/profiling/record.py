"""One record for every benchmark, so that figures from different machines and days can be set side by side:

    {"benchmark": NAME, "command": "esopt bench NAME ...", "machine": {...}, "versions": {...}, "figures": {...}}

``machine`` is where it ran (cores usable, torch's threads, the device, the checkout's commit), ``versions`` the
libraries that shape the figures (:func:`esopt_mp.profiling.versions.library_versions`), ``figures`` the
benchmark's own measurements.
"""
from __future__ import annotations

import json
import os
import shlex
import sys

from esopt_mp.profiling.versions import library_versions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _git_dir() -> str | None:
    """The checkout's git directory: ``.git``, or where a worktree's ``.git`` file points (``gitdir: ...``)."""
    git = os.path.join(ROOT, ".git")
    if os.path.isfile(git):
        with open(git) as f:
            line = f.read().strip()
        if not line.startswith("gitdir: "):
            return None
        git = os.path.normpath(os.path.join(ROOT, line[len("gitdir: "):]))
    return git if os.path.isdir(git) else None


def git_commit() -> str | None:
    """The checkout's commit, read from its git directory (no git process; worktrees, a detached HEAD and packed
    refs included), or None outside a git checkout."""
    try:
        git = _git_dir()
        if git is None:
            return None
        with open(os.path.join(git, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref: "):
            return head or None  # a detached HEAD holds the commit itself
        ref = head[5:]
        common = git  # a worktree keeps its HEAD and shares the main checkout's refs (its "commondir")
        if os.path.isfile(os.path.join(git, "commondir")):
            with open(os.path.join(git, "commondir")) as f:
                common = os.path.normpath(os.path.join(git, f.read().strip()))
        for d in dict.fromkeys((git, common)):
            if os.path.isfile(os.path.join(d, ref)):
                with open(os.path.join(d, ref)) as f:
                    return f.read().strip() or None
        with open(os.path.join(common, "packed-refs")) as f:  # packed by git gc: "<sha> <ref>" lines
            return next((line.split()[0] for line in f if line.rstrip().endswith(" " + ref)), None)
    except OSError:
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
        return shlex.join([*prog.split(), *argv[1:]])
    return shlex.join(["python", os.path.relpath(argv[0], ROOT) if argv and argv[0] else "-", *argv[1:]])


def bench_record(name: str, figures: dict, argv: list[str] | None = None) -> dict:
    """The record of benchmark ``name`` with ``figures``."""
    return {"benchmark": name, "command": command_line(argv), "machine": machine(), "versions": library_versions(),
            "figures": figures}


def print_record(name: str, figures: dict) -> dict:
    """Print the record as one JSON line on stdout (what every benchmark ends with) and return it."""
    rec = bench_record(name, figures)
    print(json.dumps(rec), flush=True)
    return rec
