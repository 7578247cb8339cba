"""Perturb / restore / update over the local shards a rank holds.

Every operation streams eps in blocks (see :mod:`esopt_mp.es.noise`), so the
extra memory of any call is one fp32 accumulator of at most ``chunk_elems``
(update only) plus one noise block, whatever the size of the largest tensor.
The exceptions are the state a mode keeps by design: the ``snapshot`` copy,
the ``fp32_host`` master and, with ``decay_to="start"``, the starting weights
theta0, all of the local shard, in host memory.

Precision modes (docs/concepts.md, "Precision modes"):

- ``restore="subtract"``: add sigma*eps, later subtract it again; exact in
  fp32 up to rounding, drifts in bf16.
- ``restore="snapshot"``: copy of the local shard (host, pinned on CUDA,
  exactly the shard's size: :mod:`esopt_mp.es.hostmem`), copied back on
  restore: bit-exact in every dtype.
- ``master="fp32_host"``: an fp32 master of the shard on the host; updates
  accumulate there and device weights are re-rounded from it, so bf16 weights
  still absorb steps far below their resolution. Restore copies the master back.

Weight decay (``es.weight_decay``, ``es.decay_to``): ``zero`` decays toward 0,
theta <- (1 - alpha*wd) theta + step; ``start`` decays toward the run's
starting weights, theta <- theta - alpha*wd (theta - theta0) + step, with
theta0 the local shard as the Perturber found it (:meth:`Perturber.set_start_`),
kept on the host in the shard's own dtype. That copy is exact in every mode:
the fp32 master starts as the exact upcast of the same weights.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from esopt_mp.es import lowrank
from esopt_mp.es.backend import resolve as resolve_backend
from esopt_mp.es.config import DECAY_TARGETS, MASTER_MODES, MAX_RANK, NOISE_MODES, RESTORE_MODES
from esopt_mp.es.hostmem import HostCopies
from esopt_mp.es.noise import group_whole_tensors, stream
from esopt_mp.es.shard import LocalShard
from esopt_mp.typed import check, check_choice

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the Triton kernels' fp32 math; not fp64


def exact_restore(restore: str, master: str) -> bool:
    """Whether :meth:`Perturber.restore` gives the weights back bit for bit (a snapshot or the fp32 master is copied
    back); ``subtract`` alone leaves each perturb/restore's rounding in them, so replay must re-apply those too."""
    return restore == "snapshot" or master == "fp32_host"


def _finite(name: str, v: float, nonneg: bool = False) -> float:
    try:
        v = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {v!r}") from None
    if not math.isfinite(v) or (nonneg and v < 0):
        raise ValueError(f"{name} must be finite{' and >= 0' if nonneg else ''}, got {v}")
    return v


class Perturber:
    """ES operations on a fixed list of local shards (all ranks call them in lockstep)."""

    def __init__(
        self,
        shards: Iterable[LocalShard],
        *,
        restore: str = "snapshot",
        master: str = "none",
        chunk_elems: int = 1 << 24,
        block: int | None = None,
        noise_backend: str = "auto",
        work_passes: float | None = None,
        cache_warm: bool | None = None,
        decay_to: str = "zero",
        noise: str = "full",
        rank: int = 1,
    ):
        check_choice(restore, RESTORE_MODES, "es.restore")
        check_choice(noise, NOISE_MODES, "es.noise")
        check(isinstance(rank, int) and 1 <= rank <= MAX_RANK, "es.rank", f"must be in 1..{MAX_RANK}, got {rank!r}")
        check_choice(master, MASTER_MODES, "es.master")
        check_choice(decay_to, DECAY_TARGETS, "es.decay_to")
        if chunk_elems < 1:
            raise ValueError(f"chunk_elems must be >= 1, got {chunk_elems}")
        self.shards = list(shards)
        boxes = [(s.info.name, s.info.offset) for s in self.shards]  # a fused runtime tensor may hold several
        if len(set(boxes)) != len(boxes):  # boxes of one canonical tensor (vLLM); the same box twice is an error
            raise ValueError("each (canonical tensor name, offset) may appear only once among the local shards")
        self.restore_mode, self.master_mode = restore, master
        self.chunk_elems = int(chunk_elems)
        # a noise block's temporaries (~40 B/element) stay under ~10% of the fp32 chunk
        self.block = int(block) if block else max(1 << 14, min(1 << 17, self.chunk_elems // 128))
        self.noise_backend = noise_backend
        self.noise, self.rank = noise, rank
        # per shard: "full" (its own eps), "lowrank" (a rank-r product: es.noise=lowrank's 2-D tensors) or "none"
        self.kinds = ["full" if noise == "full" else "lowrank" if lowrank.applies(s.info) else "none"
                      for s in self.shards]
        per_device: dict[torch.device, int] = {}
        for s in self.shards:
            per_device[s.tensor.device] = per_device.get(s.tensor.device, 0) + s.info.numel
        # the concrete backend per device (esopt_mp.es.backend); "triton" runs the fused kernels
        # ``work_passes``: how many times the run will regenerate each local element's noise (auto decides on it)
        self.backends = {dev: resolve_backend(noise_backend, dev, n, None if work_passes is None else n * work_passes,
                                              cache_warm) for dev, n in per_device.items()}
        self._banks = None  # es.noise=lowrank: the factors' counters per device (factors())
        self._wholes = group_whole_tensors(self.shards, [k == "full" and self.backends[s.tensor.device] != "triton"
                                                         for s, k in zip(self.shards, self.kinds)],
                                           self.backends, self.block)
        self._in_whole = {k for _, ks in self._wholes for k in ks}
        self._active: tuple[int, float, int] | None = None
        tensors = [s.tensor for s in self.shards]
        self.master_host = HostCopies(tensors, torch.float32).copy_from_(tensors) if master == "fp32_host" else None
        self._master = self.master_host.tensors if self.master_host else None
        self.snapshot_host: HostCopies | None = None  # allocated once, refreshed when stale
        self._snapshot: list[torch.Tensor] | None = None  # its tensors while they hold the current weights
        self.decay_to = decay_to  # the rule update() applies unless told otherwise
        self.start_host: HostCopies | None = None  # theta0 for decay_to="start" (set_start_)
        self._start: list[torch.Tensor] | None = None
        if decay_to == "start":  # the weights as built: the run's start (a resume loads its checkpoint after this)
            self.set_start_()

    # ------------------------------------------------------------------ state
    @property
    def exact_restore(self) -> bool:
        return exact_restore(self.restore_mode, self.master_mode)

    @property
    def is_perturbed(self) -> bool:
        return self._active is not None

    @property
    def host_bytes(self) -> int:
        """Host memory held for the precision mode (snapshot and/or fp32 master) and theta0, in bytes."""
        return sum(h.nbytes for h in (self.snapshot_host, self.master_host, self.start_host) if h is not None)

    @property
    def has_start(self) -> bool:
        """Whether theta0 is kept (``decay_to="start"`` can be applied)."""
        return self._start is not None

    def set_start_(self, tensors: Sequence[torch.Tensor] | None = None) -> None:
        """Keep theta0, the weights ``decay_to="start"`` decays toward: ``tensors`` (shaped like the local shards,
        e.g. rebuilt from the base model's files) or by default the local weights as they are now.

        Stored on the host (pinned on CUDA, :class:`~esopt_mp.es.hostmem.HostCopies`) in each shard's own dtype:
        1x the shard's bytes. Exact under ``fp32_host`` too, as long as it is taken before the first update or
        checkpoint load (the master is then the exact upcast of these weights): the constructor takes it.
        """
        if self._active is not None:
            raise RuntimeError("set_start_() while perturbed; restore() first")
        src = [s.tensor for s in self.shards] if tensors is None else list(tensors)
        if len(src) != len(self.shards):
            raise ValueError(f"set_start_: {len(src)} tensors for {len(self.shards)} local shards")
        for shard, t in zip(self.shards, src):
            if tuple(t.shape) != tuple(shard.tensor.shape):
                raise ValueError(f"{shard.info.name}: start of shape {tuple(t.shape)}, expected "
                                 f"{tuple(shard.tensor.shape)}")
        if self.start_host is None:
            self.start_host = HostCopies([s.tensor for s in self.shards])
        self.start_host.copy_from_(src)
        self._start = self.start_host.tensors

    @property
    def numel(self) -> int:
        return sum(s.info.numel for s in self.shards)

    def _stream(self, seed: int, shard: LocalShard, a: int, b: int):
        return stream(seed, shard.info, a, b, block=self.block, device=shard.tensor.device,
                      backend=self.backends[shard.tensor.device])

    def _fused(self, shard: LocalShard) -> bool:
        """Whether the fused Triton kernels do this shard's arithmetic (fp32 math: not fp64 weights)."""
        return self.backends[shard.tensor.device] == "triton" and shard.tensor.dtype in FUSED_DTYPES

    def factors(self, seed: int, k: int | None = None):
        """(A, B) of member ``seed`` for low-rank shard ``k``'s local slice (:func:`esopt_mp.es.lowrank.factors`); all
        shards' as {k: (A, B)} when ``k`` is None, from one kernel call per device (:class:`~esopt_mp.es.lowrank.
        FactorBank`)."""
        if self._banks is None:  # built on first use: a full-rank run never needs it
            by_dev: dict = {}
            for j, s in enumerate(self.shards):
                if self.kinds[j] == "lowrank":
                    by_dev.setdefault(s.tensor.device, []).append(j)
            self._banks = [(lowrank.FactorBank([self.shards[j].info for j in ks], self.rank, dev),
                            ks) for dev, ks in by_dev.items()]
        out = {}
        for bank, ks in self._banks:
            out.update(zip(ks, bank.factors(seed)))
        return out if k is None else out[k]

    def _add_noise_(self, seed: int, scale: float) -> None:
        for whole, ks in self._wholes:
            for j, z in whole.views(whole.normals(seed)):
                self.shards[ks[j]].tensor.view(-1).add_(z, alpha=scale)
        facs = self.factors(seed) if self.noise == "lowrank" else {}
        for k, shard in enumerate(self.shards):
            if k in self._in_whole or self.kinds[k] == "none":
                continue
            if self.kinds[k] == "lowrank":
                lowrank.add_(shard.tensor, shard.info, *facs[k], scale, self.rank, self.chunk_elems)
                continue
            flat = shard.tensor.view(-1)
            if self._fused(shard):
                from esopt_mp.es import triton_noise  # on use: triton is an optional extra
                triton_noise.axpy_(flat, seed, shard.info, scale)
                continue
            for p, z in self._stream(seed, shard, 0, shard.info.numel):
                flat[p : p + z.numel()].view_as(z).add_(z, alpha=scale)

    def _copy_back_(self, sources: list[torch.Tensor]) -> None:
        for shard, src in zip(self.shards, sources):
            dst, src = shard.tensor.view(-1), src.view(-1)
            for a in range(0, dst.numel(), self.chunk_elems):
                dst[a : a + self.chunk_elems].copy_(src[a : a + self.chunk_elems], non_blocking=False)

    def state_tensors(self) -> list[torch.Tensor]:
        """What defines the weights: the fp32 masters if kept, else the local tensors."""
        if self._active is not None:
            raise RuntimeError("state_tensors() while perturbed; restore() first")
        return self._master if self._master is not None else [s.tensor for s in self.shards]

    def load_state_(self, states: list[torch.Tensor]) -> None:
        """Inverse of :meth:`state_tensors` (shapes must match)."""
        if self._active is not None:
            raise RuntimeError("load_state_() while perturbed; restore() first")
        targets = self._master if self._master is not None else [s.tensor for s in self.shards]
        for shard, dst, src in zip(self.shards, targets, states):
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{shard.info.name}: state of shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(src)
        if self._master is not None:
            self._copy_back_(self._master)
        self._snapshot = None

    # ------------------------------------------------------------------ ops
    def perturb(self, seed: int, sigma: float, sign: int = 1) -> None:
        """theta += sign * sigma * eps(seed) on every local shard."""
        if self._active is not None:
            raise RuntimeError(f"perturb() called while member seed {self._active[0]} is active; restore() first")
        sigma = _finite("sigma", sigma, nonneg=True)
        if sign not in (1, -1):
            raise ValueError(f"sign must be +1 or -1, got {sign}")
        if self.restore_mode == "snapshot" and self._master is None and self._snapshot is None:
            tensors = [s.tensor for s in self.shards]
            if self.snapshot_host is None:
                self.snapshot_host = HostCopies(tensors)
            self._snapshot = self.snapshot_host.copy_from_(tensors).tensors
        self._add_noise_(seed, sign * sigma)
        self._active = (int(seed), sigma, sign)

    def restore(self) -> None:
        """Undo the active perturbation (exactly, except ``subtract`` in low precision)."""
        if self._active is None:
            raise RuntimeError("restore() called with no active perturbation")
        seed, sigma, sign = self._active
        if self._master is not None:
            self._copy_back_(self._master)
        elif self.restore_mode == "snapshot":
            self._copy_back_(self._snapshot)
        else:
            self._add_noise_(seed, -sign * sigma)
        self._active = None

    def update(
        self,
        seeds: Sequence[int],
        signs: Sequence[int],
        weights: Sequence[float],
        alpha: float,
        weight_decay: float = 0.0,
        decay_to: str | None = None,
    ) -> None:
        """theta <- (1 - alpha*wd) * theta + (alpha / G) * sum_i w_i * sign_i * eps(seed_i).

        With ``decay_to="start"`` (None: the Perturber's own ``decay_to``) the decay pulls toward theta0 instead:
        theta <- theta + (step - alpha*wd * (theta - theta0)), the bracket in fp32 (the difference taken in fp32),
        added to theta once. One fused pass per chunk: the sum accumulates in fp32 and is applied once, so each
        weight is rounded once per update.
        """
        if self._active is not None:
            raise RuntimeError("update() called while perturbed; restore() first")
        if not len(seeds) == len(signs) == len(weights) or not len(seeds):
            raise ValueError(
                f"seeds, signs and weights must be non-empty and of equal length, got "
                f"{len(seeds)}, {len(signs)}, {len(weights)}"
            )
        alpha = _finite("alpha", alpha, nonneg=True)
        weight_decay = _finite("weight_decay", weight_decay, nonneg=True)
        rule = self.decay_to if decay_to is None else decay_to
        if rule not in DECAY_TARGETS:
            check_choice(rule, DECAY_TARGETS, "es.decay_to")  # the config's own line
        if rule == "start" and self._start is None:
            raise RuntimeError("decay_to='start' needs the run's starting weights: build the Perturber with "
                               "decay_to='start' (or call set_start_() on the base weights) before any update")
        ws = [_finite(f"weights[{i}]", w) for i, w in enumerate(weights)]
        if any(s not in (1, -1) for s in signs):
            raise ValueError(f"signs must be +1 or -1, got {list(signs)}")
        scale = alpha / len(ws)
        pull = alpha * weight_decay if rule == "start" else 0.0  # toward theta0; 0: the plain path, bit for bit
        decay = 1.0 - alpha * weight_decay if rule == "zero" else 1.0
        members = [(int(s), g * w) for s, g, w in zip(seeds, signs, ws) if w != 0.0]
        packed = {}
        if any(b == "triton" for b in self.backends.values()):
            from esopt_mp.es import triton_noise  # on use: triton is an optional extra

            packed = {dev: triton_noise.pack_members(members, dev) for dev, b in self.backends.items() if b == "triton"}
        fused_in_place = [self._fused(s) and not pull and self.kinds[k] == "full"  # no theta0 operand: it sums,
                          and (self._master is None or self._master[k].device == s.tensor.device)  # torch applies
                          for k, s in enumerate(self.shards)]
        decays = decay != 1.0 or pull != 0.0  # tensors this mode does not perturb still take the decay
        for whole, ks in self._wholes:  # small whole tensors: the sum over members in one buffer per group
            acc = torch.zeros(whole.size, device=whole.q.device)
            for seed, w in members:
                acc.add_(whole.normals(seed), alpha=w)
            acc.mul_(scale)
            for j, part in whole.views(acc):
                self._apply_(ks[j], 0, part.numel(), part, decay, pull)
        sizes: dict[torch.device, int] = {}  # one accumulator per device, reused by every shard that needs it
        for k, (shard, done) in enumerate(zip(self.shards, fused_in_place)):
            dev = shard.tensor.device
            if not done and k not in self._in_whole and (self.kinds[k] != "none" or decays):
                whole_row = shard.info.local_shape[1] if self.kinds[k] == "lowrank" else 0
                sizes[dev] = max(sizes.get(dev, 0), min(self.chunk_elems, shard.info.numel), whole_row)
        bufs = {dev: torch.empty(n, dtype=torch.float32, device=dev) for dev, n in sizes.items()}
        member_facs = [self.factors(seed) for seed, _ in members] if self.noise == "lowrank" else []
        for k, shard in enumerate(self.shards):
            if k in self._in_whole:
                continue
            if self.kinds[k] == "none" and not decays:
                continue
            if self.kinds[k] == "lowrank":
                self._update_lowrank_(k, [(*f[k], w) for f, (_, w) in zip(member_facs, members)], scale,
                                      bufs[shard.tensor.device], decay, pull)
                continue
            mine = members if self.kinds[k] == "full" else []  # "none": the decay alone
            flat = shard.tensor.view(-1)
            n = shard.info.numel
            if fused_in_place[k]:  # one pass, the sum in registers, into the weights or the same-device master
                triton_noise.update_(flat, shard.info, members, scale, decay, packed=packed[shard.tensor.device],
                                     master=None if self._master is None else self._master[k].view(-1))
                continue
            acc_buf = bufs[shard.tensor.device]
            for a in range(0, n, self.chunk_elems):
                b = min(n, a + self.chunk_elems)
                acc = acc_buf[: b - a]
                if self._fused(shard) and mine:  # host master: the kernel sums on the device, torch applies it
                    triton_noise.update_(acc, shard.info, members, scale, 1.0, start=a, acc_only=True,
                                         packed=packed[shard.tensor.device])
                else:
                    acc.zero_()
                    for seed, w in mine:
                        for p, z in self._stream(seed, shard, a, b):
                            acc[p - a : p - a + z.numel()].view_as(z).add_(z, alpha=w)
                    acc.mul_(scale)
                self._apply_(k, a, b, acc, decay, pull)
        self._snapshot = None  # stale: refreshed at the next perturb

    def _update_lowrank_(self, k: int, facs: list, scale: float, buf: torch.Tensor, decay: float, pull: float) -> None:
        for a, b, acc in lowrank.summed(self.shards[k].info, facs, scale, self.rank, self.chunk_elems, buf):
            self._apply_(k, a, b, acc, decay, pull)

    def _apply_(self, k: int, a: int, b: int, acc: torch.Tensor, decay: float, pull: float = 0.0) -> None:
        """Elements [a, b) of shard ``k`` take the update ``acc`` (already scaled), after the decay (``decay``:
        toward zero; ``pull``: toward theta0, folded into ``acc`` so each weight is rounded once)."""
        flat = self.shards[k].tensor.view(-1)
        if self._master is not None:
            m = self._master[k].view(-1)[a:b]
            if pull:
                acc, t0 = acc.to(m.device), self._start[k].view(-1)[a:b]
                for c in range(0, b - a, self.block):
                    d = min(b - a, c + self.block)
                    m[c:d].add_(_pulled(acc[c:d], m[c:d], t0[c:d], pull))
            else:
                if decay != 1.0:
                    m.mul_(decay)
                m.add_(acc.to(m.device))
            flat[a:b].copy_(m)
        else:
            t0 = self._start[k].view(-1)[a:b].to(flat.device) if pull else None  # one chunk, the shard's dtype
            # block by block: a mixed-dtype in-place op upcasts its operands, so its temporaries
            for c in range(0, b - a, self.block):  # are block-sized, not 2 more fp32 chunks (memprof)
                d = min(b - a, c + self.block)
                w_ = flat[a + c : a + d]
                if pull:
                    w_.copy_(_pulled(acc[c:d], w_, t0[c:d], pull).add_(w_))
                elif decay != 1.0:
                    w_.copy_(acc[c:d].add_(w_, alpha=decay))
                else:
                    w_.add_(acc[c:d])


def _pulled(acc: torch.Tensor, w: torch.Tensor, t0: torch.Tensor, pull: float) -> torch.Tensor:
    """``acc -= pull * (w - t0)`` in place (the decay toward the start), the difference taken in fp32 (or in ``w``'s
    wider dtype): a low-precision difference would round before it is scaled. Returns ``acc``."""
    return acc.add_(torch.sub(w if w.element_size() >= 4 else w.float(), t0), alpha=-pull)
