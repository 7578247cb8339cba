"""Run one function in a local world of N spawned CPU processes (gloo): for testing and benchmarking distributed
code on one machine -- the project's tests and benchmarks, and a plugin's own. Not the trainer's way in
(launch/train.py reads its world from the launcher: :mod:`esopt_mp.parallel.launcher`)."""
from __future__ import annotations

import os
import socket
import time
import traceback
import warnings

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, errors):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from esopt_mp.parallel import close_distributed

    ok = False
    try:
        fn(rank, world, *args)
        ok = True
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        close_distributed(drain=ok, drained=lambda: errors.put((rank, None)))  # None: every rank's fn returned


def run_world(world: int, fn, *args, timeout: float = 600.0) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes; re-raise the first failure.

    A world still running after ``timeout`` seconds (a rank stuck in a collective its peers never
    joined) is killed and reported, instead of hanging the caller. A rank killed by a signal after every
    rank's ``fn`` returned and met the others at the final barrier (gloo can abort in its destructor when a
    peer closes its sockets first) is reported as a warning, not a failure: the work was done.
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    deadline = time.monotonic() + timeout
    try:
        procs = mp.start_processes(_entry, args=(world, free_port(), fn, args, errors), nprocs=world, join=False,
                                   start_method="spawn")
        while not procs.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in procs.processes:
                    p.kill()
                raise AssertionError(f"a world of {world} ranks was still running after {timeout:g} s "
                                     f"(a rank waiting in a collective its peers never joined?)")
    except Exception as exc:
        msgs, drained = [], []
        while not errors.empty():
            rank, tb = errors.get()
            if tb is None:
                drained.append(rank)
            else:
                msgs.append("rank %d:\n%s" % (rank, tb))
        if drained and not msgs and isinstance(exc, mp.ProcessExitedException) and exc.signal_name:
            warnings.warn(f"rank {exc.error_index} died by {exc.signal_name} in its teardown, after every rank's "
                          f"work returned", RuntimeWarning, stacklevel=2)
            return
        raise AssertionError("\n".join(msgs) or str(exc)) from exc
