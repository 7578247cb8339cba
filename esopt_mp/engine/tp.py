"""An engine replicated over a tensor-parallel group: the TP leader generates, its peers follow by themselves.

The TP leader of each group owns tasks and environments; its peers hold the other shards of the same model and
must run the same sharded forward passes. :class:`TPEngine` wraps any :class:`~esopt_mp.engine.base.Engine` and
sends the peers what they need from inside ``new_conversation`` / ``generate``: the batch's conversation seeds
and member slots (``("new", seeds, members)``, sent before its first generation; ``("add", seeds, members)`` for
conversations that join it later),
each generation's rows, new token ids and caps (``("gen", live, ids, caps)``), and after each generation a checksum
of the sampled tokens (a mismatch raises on every rank).
Callers wrap everything that generates in :meth:`TPEngine.lead`: the leader runs it while its peers follow until it
returns (``("end",)``); so no caller branches on the rank to generate. At tp = 1 the wrapper passes calls through.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

from esopt_mp.core.types import Generation
from esopt_mp.engine.base import Engine, SamplingParams, generate_capped

T = TypeVar("T")


class TPChannel:
    """Leader -> peers messages and token checksums over the tp group (no-ops without TP).

    Both go through ``dims.comm``, which puts them on the backend's device and counts their bytes.
    """

    def __init__(self, dims=None):
        self.dims = dims
        self.on = dims is not None and dims.distributed and dims.tp > 1
        self.src = dims.rank - dims.tp_rank if self.on else 0

    def send(self, payload) -> None:
        if self.on:
            self.dims.comm.broadcast_object(payload, src=self.src, dim="tp")

    def recv(self):
        return self.dims.comm.broadcast_object(None, src=self.src, dim="tp")

    def verify(self, gens: list[Generation]) -> None:
        if not self.on:
            return
        h = 0
        for g in gens:
            for t in g.token_ids:
                h = (h * 1000003 + t + 1) % (1 << 61)
        x = self.dims.comm.all_reduce(torch.tensor([h, -h], dtype=torch.int64), "max", dim="tp")
        if int(x[0]) != -int(x[1]):
            raise RuntimeError(f"tp ranks sampled different tokens (rank {self.dims.rank}); logits diverged")


class TPEngine:
    """``engine`` on one rank of a tp group (``dims``: ParallelDims, or None for one process)."""

    def __init__(self, engine: Engine, dims=None):
        if isinstance(engine, TPEngine):
            raise TypeError("TPEngine wraps an engine, not another TPEngine")
        self.inner, self.dims = engine, dims
        self.chan = TPChannel(dims)
        self.is_leader = not self.chan.on or dims.tp_rank == 0
        self.followed: list[list[int]] = []  # a peer's last follow: the token ids of every conversation it held
        self._batch: list = []  # the leader's conversations of the batch the peers hold (or will get)
        self._seeds: list[tuple[int, int]] | None = None  # their (seed, member slot), while not yet sent
        self._joined: list[tuple[int, int]] = []  # those of conversations joining the batch already sent, not yet sent
        self._depth = 0  # nested lead() calls on the leader: only the outermost ends the follow
        self._exposed = False  # the peers are inside a generation with the leader: releasing them is unsafe

    @property
    def tokenizer(self):
        return self.inner.tokenizer

    @property
    def pad_id(self) -> int:
        return self.inner.pad_id

    @property
    def stats(self):
        return self.inner.stats

    @property
    def max_context(self) -> int | None:
        return getattr(self.inner, "max_context", None)

    def close(self) -> None:
        self.inner.close()

    # ------------------------------------------------------------------ leader
    def new_conversation(self, cid: int, seed: int, join: bool = False, member: int = -1):
        """``join``: the conversation joins the batch the peers hold instead of starting the next one (a server
        opens conversations while the others go on); ``member``: its member slot (es.member_batch), which the peers
        are sent too: their rows must add the same member's terms."""
        conv = _open(self.inner, cid, seed, member)
        if self.chan.on:
            if join and self._seeds is None and self._batch:
                self._batch.append(conv)
                self._joined.append((seed, member))
                return conv
            if self._seeds is None:  # the batch the peers hold was sent: this conversation starts the next one
                self._batch, self._seeds = [], []
            self._batch.append(conv)
            self._seeds.append((seed, member))
        return conv

    def generate(self, convs: list, new_ids: list[list[int]], params: SamplingParams,
                 max_new: list[int] | None = None) -> list[Generation]:
        if not self.chan.on:
            return generate_capped(self.inner, convs, new_ids, params, max_new)
        if not self._depth:
            raise RuntimeError("TPEngine.generate at tp > 1 outside TPEngine.lead: the peers would not follow")
        self._send_batch()
        index = {id(c): k for k, c in enumerate(self._batch)}
        if any(id(c) not in index for c in convs):
            raise ValueError("TPEngine.generate: a conversation of an earlier batch (its peers' copy is gone)")
        self.chan.send(("gen", [index[id(c)] for c in convs], list(new_ids), max_new))
        self._exposed = True  # from here until the checksum, the peers run the same forward passes
        gens = generate_capped(self.inner, convs, new_ids, params, max_new)
        self.chan.verify(gens)
        self._exposed = False
        return gens

    def _send_batch(self) -> None:
        if self._seeds is not None:
            self.chan.send(("new", [s for s, _ in self._seeds], [m for _, m in self._seeds]))
            self._seeds = None
        if self._joined:
            self.chan.send(("add", [s for s, _ in self._joined], [m for _, m in self._joined]))
            self._joined = []

    def lead(self, fn: Callable[[], T], sampling: SamplingParams, default=None) -> T:
        """``fn()`` on the TP leader, its peers following every generation it makes with ``sampling`` until it
        returns; on a peer: the follow, then ``default``. If ``fn`` raises on the leader outside a generation (a
        tokenizer error before the first forward, say), the peers are released first, so they return instead of
        waiting for the next message until the collective timeout; a failure inside a generation's sharded
        forward leaves them in it."""
        if not self.chan.on:
            return fn()
        if not self.is_leader:
            self.follow(sampling)
            return default
        self._depth += 1
        ok = False
        try:
            out = fn()
            ok = True
            return out
        finally:
            self._depth -= 1
            if not self._depth:
                if ok:
                    self._send_batch()  # conversations that never generated (all resets failed): the peers' too
                else:
                    self._seeds, self._joined = None, []
                if ok or not self._exposed:
                    self.chan.send(("end",))
                self._batch, self._exposed = [], False

    # ------------------------------------------------------------------ peers
    def follow(self, sampling: SamplingParams) -> list[list[int]]:
        """A peer's side of :meth:`lead`: join every generation until the leader ends; the token ids of every
        conversation followed (also in :attr:`followed`)."""
        convs, done = [], []
        while True:
            msg = self.chan.recv()
            if msg[0] == "new":
                done += [list(c.ids) for c in convs]
                convs = [_open(self.inner, i, s, m) for i, (s, m) in enumerate(zip(msg[1], msg[2]))]
            elif msg[0] == "add":
                convs += [_open(self.inner, len(convs) + i, s, m) for i, (s, m) in enumerate(zip(msg[1], msg[2]))]
            elif msg[0] == "gen":
                _, live, ids, caps = msg
                self.chan.verify(generate_capped(self.inner, [convs[i] for i in live], ids, sampling, caps))
            elif msg[0] == "end":
                self.followed = done + [list(c.ids) for c in convs]
                return self.followed
            else:
                raise RuntimeError(f"unknown message from the tp leader: {msg[0]!r}")


def _open(engine: Engine, cid: int, seed: int, member: int):
    """``engine``'s new conversation, of member slot ``member`` when one is set (engines without member batches
    take no slot)."""
    return engine.new_conversation(cid, seed, member=member) if member != -1 else engine.new_conversation(cid, seed)


def replicated(engine: Engine, dims=None) -> TPEngine:
    """``engine`` as a :class:`TPEngine` over ``dims``' tp group (an engine already wrapped is returned as is)."""
    return engine if isinstance(engine, TPEngine) else TPEngine(engine, dims)
