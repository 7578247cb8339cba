"""A whole population in one forward: every linear and embedding adds each row's member's low-rank term.

Under ``es.noise=lowrank`` member i's weights are ``W + c_i A_i B_i^T`` with ``c_i = sign_i sigma / sqrt(r)``
(:mod:`esopt_mp.es.lowrank`). So instead of perturbing the weights in place and running the members one after
another, a batch whose row b belongs to member ``rows[b]`` computes, in every linear,
``y = x W^T + c_i (x B_i) A_i^T`` and, in an embedding, ``W[ids] + c_i A_i[ids] B_i^T``: the base weights stay
shared and unperturbed, the extra work is O((m + n) r) per row and token, and a row with member -1 plays the base
weights (the held-out evaluation can share the batch).

The factors are each rank's own rows (:meth:`esopt_mp.es.Perturber.factors`), so under tensor parallelism a
column-parallel linear adds its rows of the output and a row-parallel one adds its partial sum before the all-reduce
(the term is linear in x). Tied weights (an lm_head sharing the embedding) find their shard by the tensor itself.

Results equal the in-place perturbation up to float rounding (the two orders of the same sum), not bit for bit: a
run evaluates its members one way or the other, never a mixture (``es.member_batch``).
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
        if not self.modules:
            raise ValueError("no linear or embedding of the model holds a low-rank shard: nothing to batch")
        self.rows: torch.Tensor | None = None  # per batch row, its member's slot (-1: the base weights)
        self._a: dict[int, torch.Tensor] = {}  # shard k -> [G + 1, l0, r] (the last slot zeros: the base)
        self._b: dict[int, torch.Tensor] = {}  # shard k -> [G + 1, l1, r]
        self._c: torch.Tensor | None = None  # [G + 1] coefficients
        self._sel: dict = {}
        self._hooks = [m.register_forward_hook(self._hook) for m in self.modules]

    def set_members(self, seeds, signs, sigma: float) -> None:
        """Slots 0..G-1 are these members (their factors made once, ~2 G (m + n) r floats per matrix)."""
        r = self.weights.rank
        every = [self.weights.factors(s) for s in seeds]  # {shard: (A, B)} per member, one kernel call each
        for k in set(self.modules.values()):
            facs = [f[k] for f in every]
            shard = self.weights.shards[k]
            dt = shard.tensor.dtype
            zero_a = torch.zeros(shard.info.local_shape[0], r, device=shard.tensor.device)
            zero_b = torch.zeros(shard.info.local_shape[1], r, device=shard.tensor.device)
            self._a[k] = torch.stack([a for a, _ in facs] + [zero_a]).to(dt)
            self._b[k] = torch.stack([b for _, b in facs] + [zero_b]).to(dt)
        self._c = torch.tensor([g * sigma * lowrank.scale(r) for g in signs] + [0.0])
        self.rows, self._sel = None, {}

    def set_rows(self, members) -> None:
        """The member slot of each row of the next forwards' batch (-1: the base weights)."""
        if self._c is None:
            raise RuntimeError("set_members() before set_rows()")
        g = self._c.numel() - 1
        rows = torch.as_tensor(list(members), dtype=torch.long)
        if rows.numel() and (int(rows.min()) < -1 or int(rows.max()) >= g):
            raise ValueError(f"member slots must be in -1..{g - 1}, got {rows.tolist()}")
        rows = torch.where(rows < 0, g, rows)
        if self.rows is None or not torch.equal(rows, self.rows):  # decoding keeps its rows until one finishes
            self.rows = rows
            self._sel = {}  # per shard: its factors and coefficients gathered for these rows, made on first use

    def _hook(self, mod, args, out):
        if self.rows is None:
            return out
        k = self.modules[mod]
        x = args[0]
        if x.shape[0] != self.rows.numel():
            raise RuntimeError(f"a batch of {x.shape[0]} rows, {self.rows.numel()} member slots set")
        if k not in self._sel:
            rows = self.rows.to(out.device)
            c = self._c.to(device=out.device, dtype=out.dtype)[rows]
            self._sel[k] = (c, self._a[k][rows], self._b[k][rows])
        c, a, b = self._sel[k]  # [R], [R, l0, r], [R, l1, r]
        if isinstance(mod, torch.nn.Embedding):  # W[ids] + c A[ids] B^T
            lead = x.shape[1:]
            ai = a.gather(1, x.reshape(x.shape[0], -1, 1).expand(-1, -1, a.shape[2]))  # [R, T, r]
            term = torch.bmm(ai, b.transpose(1, 2)).view(*x.shape[:1], *lead, -1)
        else:  # x W^T + c (x B) A^T, over the trailing dim of any [R, ..., n]
            xs = x.reshape(x.shape[0], -1, x.shape[-1])
            term = torch.bmm(torch.bmm(xs, b), a.transpose(1, 2)).view(*out.shape)
        return out + c.view(-1, *([1] * (out.dim() - 1))) * term

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.rows = None
