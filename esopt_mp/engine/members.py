"""A whole population in one forward: every linear and embedding adds each row's member's low-rank term.

Under ``es.noise=lowrank`` member i's weights are ``W + c_i A_i B_i^T`` with ``c_i = sign_i sigma / sqrt(r)``
(:mod:`esopt_mp.es.lowrank`). So instead of perturbing the weights in place and running the members one after
another, a batch whose row b belongs to member ``rows[b]`` computes, in every linear,
``y = x W^T + c_i (x B_i) A_i^T`` and, in an embedding, ``W[ids] + c_i A_i[ids] B_i^T``: the base weights stay
shared and unperturbed, and a row with member -1 plays the base weights (the held-out evaluation can share the
batch).

The G members' factors of a matrix are laid side by side, ``B = [B_1 .. B_G]`` (n x G r) and likewise ``A``; a
linear then adds ``((x B) * M) A^T``, where the mask M keeps, scaled by c_i, only the r columns of each row's own
member. Two plain matrix products per linear: the factors are read once per forward, never copied per row, and the
extra work is ``2 G r (m + n)`` multiply-adds per token and matrix (``G r (m + n)`` numbers held per matrix).

Runs at ``parallel.tp=1`` (the start-up check refuses more for now). Every low-rank matrix must be an ``nn.Linear``
or ``nn.Embedding`` of the model, or the hooks would play the base weights where the update moves them: anything
else is refused here. Results equal the in-place perturbation up to float rounding (the same sums in another
order), not bit for bit: a run evaluates its members one way or the other, never a mixture (``es.member_batch``).
"""
from __future__ import annotations

import torch

from esopt_mp.es import lowrank


class MemberLinears:
    """Forward hooks on a model's linears and embeddings whose weight is a low-rank shard of ``weights``."""

    def __init__(self, model: torch.nn.Module, weights):
        if getattr(weights, "noise", "full") != "lowrank":
            raise ValueError("members in one batch need es.noise=lowrank (each member's term is a rank-r product)")
        self.weights = weights
        by_tensor = {s.tensor.data_ptr(): k for k, s in enumerate(weights.shards) if weights.kinds[k] == "lowrank"}
        self.modules: dict[torch.nn.Module, int] = {}
        for mod in model.modules():
            w = getattr(mod, "weight", None)
            if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)) and w is not None \
                    and w.data_ptr() in by_tensor:
                self.modules[mod] = by_tensor[w.data_ptr()]
        missing = [weights.shards[k].info.name for k in set(by_tensor.values()) - set(self.modules.values())]
        if missing:
            raise ValueError(f"es.member_batch: {len(missing)} low-rank matrices are not the weight of an nn.Linear "
                             f"or nn.Embedding, so one batch cannot play them (first: {missing[0]}); exclude them "
                             f"(es.exclude) or set es.member_batch=false")
        self.rows: torch.Tensor | None = None  # per batch row, its member's slot (-1: the base weights)
        self._a: dict[int, torch.Tensor] = {}  # shard k -> [l0, G r]: the members' A side by side
        self._b: dict[int, torch.Tensor] = {}  # shard k -> [l1, G r]
        self._c: torch.Tensor | None = None  # [G] coefficients sign_i sigma / sqrt(r)
        self._mask: torch.Tensor | None = None  # [R, G r]: c_i on the r columns of each row's member, else 0
        self._hooks = [m.register_forward_hook(self._hook) for m in self.modules]

    def set_members(self, seeds, signs, sigma: float) -> None:
        """Slots 0..G-1 are these members (their factors made once: G (m + n) r numbers per matrix)."""
        r = self.weights.rank
        every = [self.weights.factors(s) for s in seeds]  # {shard: (A, B)} per member, one kernel call each
        for k in set(self.modules.values()):
            dt = self.weights.shards[k].tensor.dtype
            self._a[k] = torch.cat([f[k][0] for f in every], 1).to(dt)
            self._b[k] = torch.cat([f[k][1] for f in every], 1).to(dt)
        self._c = torch.tensor([g * sigma * lowrank.scale(r) for g in signs])
        self.rows, self._mask = None, None

    def set_rows(self, members) -> None:
        """The member slot of each row of the next forwards' batch (-1: the base weights)."""
        if self._c is None:
            raise RuntimeError("set_members() before set_rows()")
        g, r = self._c.numel(), self.weights.rank
        rows = torch.as_tensor(list(members), dtype=torch.long)
        if rows.numel() and (int(rows.min()) < -1 or int(rows.max()) >= g):
            raise ValueError(f"member slots must be in -1..{g - 1}, got {rows.tolist()}")
        if self.rows is not None and torch.equal(rows, self.rows):  # decoding keeps its rows until one finishes
            return
        self.rows = rows
        mask = torch.zeros(rows.numel(), g, r)
        on = rows >= 0
        mask[on, rows[on]] = self._c[rows[on]][:, None]
        self._mask = mask.view(rows.numel(), g * r)

    def _hook(self, mod, args, out):
        if self.rows is None:
            return out
        k = self.modules[mod]
        x = args[0]
        if x.shape[0] != self.rows.numel():
            raise RuntimeError(f"a batch of {x.shape[0]} rows, {self.rows.numel()} member slots set")
        mask = self._mask.to(device=out.device, dtype=out.dtype)
        a, b = self._a[k], self._b[k]  # [l0, G r], [l1, G r]
        rows = x.shape[0]
        if isinstance(mod, torch.nn.Embedding):  # W[ids] + c A[ids] B^T (a scaled embedding scales it too)
            h = a[x.reshape(rows, -1)] * mask[:, None, :]  # [R, T, G r]
            term = (h @ b.T).view(out.shape)
            scale = getattr(mod, "embed_scale", None)
            if scale is not None:
                term = term * scale.to(term.dtype) if torch.is_tensor(scale) else term * scale
        else:  # x W^T + c (x B) A^T over the trailing dim of any [R, ..., n]
            h = (x.reshape(rows, -1, x.shape[-1]) @ b) * mask[:, None, :]
            term = (h @ a.T).view(out.shape)
        return out + term

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.rows = None
