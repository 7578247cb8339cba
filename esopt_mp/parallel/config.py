"""The ``parallel`` section: the (dp, tp) layout, the process group's backend and its timeout.

Plain Python (no torch). :class:`~esopt_mp.parallel.dims.ParallelDims` and ``init_distributed`` check their
arguments with the functions below, so a bad layout reads the same from the config and from the launcher.
"""
from __future__ import annotations

import dataclasses
import math

from esopt_mp.typed import check, check_choice

BACKENDS = ("auto", "nccl", "gloo")
AUTO = "auto"  # parallel.dp: every rank the tp groups leave, world size / tp
LAUNCHERS = ("auto", "deepspeed")
SCHEDULES = ("dynamic", "static")  # which dp group evaluates which member (esopt_mp/parallel/member_queue.py)


def check_layout(dp, tp, world_size: int | None = None) -> None:
    """dp (or ``"auto"``) and tp are integers >= 1 and, given the world size, cover it exactly."""
    if dp == AUTO:
        check(isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1, "parallel.tp",
              f"must be an integer >= 1, got {tp!r}")
        check(world_size is None or world_size % tp == 0, "parallel.tp",
              f"parallel.dp=auto takes world size / tp: the world size {world_size} is not a multiple of tp={tp}")
        return
    for k, v in (("dp", dp), ("tp", tp)):
        check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"parallel.{k}",
              f"must be an integer >= 1{' or auto' if k == 'dp' else ''}, got {v!r}")
    if world_size is not None:
        check(dp * tp == world_size, "parallel", f"parallel.dp * parallel.tp must equal the world size: "
              f"{dp} * {tp} = {dp * tp} != {world_size}")


def check_timeout(timeout_s: float) -> None:
    check(math.isfinite(timeout_s) and timeout_s > 0, "parallel.timeout_s",
          f"must be a finite number of seconds > 0, got {timeout_s}")


@dataclasses.dataclass
class ParallelConfig:
    dp: int | str = AUTO  # auto: world size / tp (the launcher's world decides)
    tp: int = 1
    backend: str = "auto"
    launcher: str = "auto"  # auto | deepspeed (initialise through deepspeed.init_distributed)
    schedule: str = "dynamic"  # dynamic: groups take the next member when free; static: member m on group m % dp
    checksum_every: int = 10
    timeout_s: float = 1800.0  # of every collective (init_process_group): the longest a rank may wait for the others

    def validate(self, key: str = "parallel") -> None:
        check_layout(self.dp, self.tp)
        check_choice(self.backend, BACKENDS, f"{key}.backend")
        check_choice(self.launcher, LAUNCHERS, f"{key}.launcher")
        check_choice(self.schedule, SCHEDULES, f"{key}.schedule")
        check(self.checksum_every >= 0, f"{key}.checksum_every", f"must be >= 0, got {self.checksum_every}")
        check_timeout(self.timeout_s)

    def resolve_(self, world_size: int | None) -> "ParallelConfig":
        """``dp=auto`` becomes world size / tp (1 where no world is given: a replay, a dry run of one process)."""
        if self.dp == AUTO:
            check_layout(self.dp, self.tp, world_size)
            self.dp = world_size // self.tp if world_size else 1
        return self
