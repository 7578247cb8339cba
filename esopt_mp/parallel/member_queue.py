"""Which dp group evaluates which member of a step (the ``parallel.schedule`` setting).

- ``static``: member m belongs to dp group m % dp, fixed before the step starts; a step waits for its slowest
  group even when the others are idle.
- ``dynamic`` (default): one queue of the step's members in member order; each dp group takes the next one when
  it becomes free, so a group stuck on a slow episode (a slow site, a long page) no longer holds members back.

Which group ran a member never changes what the step records: a member's return depends only on its seed and its
episode seeds, the G returns are gathered by member index, and every update is applied in member order. The
queue is a counter in the process group's key-value store (one atomic ``add`` per claim, a few bytes, the key
deleted once the step's returns are gathered); at tp > 1 the group's TP leader claims and tells its peers (a small
object broadcast in the group), since they join its forward passes.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch.distributed as dist

from esopt_mp.parallel.config import SCHEDULES
from esopt_mp.typed import check_choice


class MemberQueue:
    """The members one dp group evaluates in a step, in increasing order, as an iterator.

    Every rank builds one queue per step, at the same point. Its store key is numbered by this world's count of
    queues under an epoch the world draws once (one broadcast), so neither a step played twice nor a restarted
    world that finds the old keys in a surviving store ever reads an old counter."""

    _epoch: tuple | None = None  # (the store, this world's epoch in it): drawn again for another world's store
    _made = 0  # queues built by this process: the number of the next one

    def __init__(self, dims, population: int, schedule: str = "dynamic"):
        if schedule not in SCHEDULES:  # the config's own line (the queue is built every step: no call otherwise)
            check_choice(schedule, SCHEDULES, "parallel.schedule")
        self.dims, self.population = dims, population
        self.dynamic = schedule == "dynamic" and dims.dp > 1 and dims.distributed
        epoch = None
        if self.dynamic:
            store = _store()
            if MemberQueue._epoch is None or MemberQueue._epoch[0] is not store:
                epoch = int(store.add("esopt_mp/epoch", 1)) if dims.rank == 0 else None
                MemberQueue._epoch = (store, dims.comm.broadcast_object(epoch, src=0, dim="world"))
                MemberQueue._made = 0  # counted from the epoch on: the same on every rank of this world
            epoch = MemberQueue._epoch[1]
        MemberQueue._made += 1
        self.key = f"esopt_mp/members/{epoch}/{MemberQueue._made}"

    def __iter__(self) -> Iterator[int]:
        if not self.dynamic:
            yield from self.dims.members(self.population)
            return
        while True:
            m = self._claim()
            if m >= self.population:
                return
            yield m

    def close(self) -> None:
        """Rank 0 deletes the step's counter, once every group is past its last claim (after the returns' gather,
        which every rank joins only when its queue is spent): a long run leaves no key per step in the store."""
        if self.dynamic and self.dims.rank == 0:
            _store().delete_key(self.key)

    def _claim(self) -> int:
        """The next member nobody took yet (>= population: none left); the TP leader asks, its peers hear."""
        dims = self.dims
        m = None
        if dims.is_tp_leader:
            m = int(_store().add(self.key, 1)) - 1
        if dims.tp > 1:
            m = dims.comm.broadcast_object(m, src=dims.rank - dims.tp_rank, dim="tp")
        return m


def _store():
    """The default process group's key-value store (the launcher's rendezvous store)."""
    if not dist.is_initialized():
        raise RuntimeError("parallel.schedule=dynamic needs the process group to be initialised")
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()
