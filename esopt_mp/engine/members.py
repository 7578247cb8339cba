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

Tensor parallelism (transformers' plan, weights as DTensors): a linear's term is added to its *local* output,
inside the forward transformers installs and before that forward reduces or gathers it, with the rank's own
factor rows (the noise spec gives every shard exactly its rows): a column-parallel shard adds its rows of the
output (its rows of A, all of B); a row-parallel shard adds ``(x_local B_local) A^T``, its partial sum, which the
layer's own all-reduce then sums with the others' (no collective of its own). A vocab-parallel embedding's lookup
is summed over the group inside its forward, so its term is added after, from the whole matrix's factors (made on
every rank from the seed: ``G r (V + H)`` numbers, no collective).

Every low-rank matrix must be an ``nn.Linear`` or ``nn.Embedding`` of the model, or the hooks would play the base
weights where the update moves them: anything else is refused here. Results equal the in-place perturbation up to
float rounding (the same sums in another order), not bit for bit: a run evaluates its members one way or the other,
never a mixture (``es.member_batch``).
"""
from __future__ import annotations

import torch

from esopt_mp.es import lowrank
from esopt_mp.es.shard import ShardInfo


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if hasattr(w, "to_local") else w


def _tp_forward_cell(name: str, mod: torch.nn.Module):
    """The closure cell holding the local forward that transformers' tensor parallelism wraps (its installed forward
    prepares the input, runs that local forward, then reduces or gathers the output), or None for a module it did
    not wrap (at tp = 1 every module: a forward hook sees what it needs there)."""
    if not getattr(mod, "_is_hooked", False) and not hasattr(mod.weight, "to_local"):
        return None
    f = mod.__dict__.get("forward")
    code = getattr(f, "__code__", None)
    if code is None or "original_forward" not in code.co_freevars:
        import transformers

        raise ValueError(f"es.member_batch at parallel.tp > 1: the forward of {name} is not the tensor-parallel "
                         f"forward of the transformers esopt_mp knows (installed: {transformers.__version__}, "
                         f"tested: 5.25), so the members' terms cannot join its partial sums; use parallel.tp=1 or "
                         f"es.member_batch=false")
    return f.__closure__[code.co_freevars.index("original_forward")]


class MemberLinears:
    """Forward hooks on a model's linears and embeddings whose weight is a low-rank shard of ``weights``."""

    def __init__(self, model: torch.nn.Module, weights):
        if getattr(weights, "noise", "full") != "lowrank":
            raise ValueError("members in one batch need es.noise=lowrank (each member's term is a rank-r product)")
        self.weights = weights
        by_tensor = {s.tensor.data_ptr(): k for k, s in enumerate(weights.shards) if weights.kinds[k] == "lowrank"}
        self.modules: dict[torch.nn.Module, tuple[int, bool]] = {}  # module -> (shard, its factors are the whole's)
        cells = {}  # linear -> the cell of its local forward inside transformers' TP forward (tp > 1)
        for name, mod in model.named_modules():
            w = getattr(mod, "weight", None)
            if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)) and w is not None \
                    and _local(w).data_ptr() in by_tensor:
                k = by_tensor[_local(w).data_ptr()]
                whole = isinstance(mod, torch.nn.Embedding) and not weights.shards[k].info.is_full
                self.modules[mod] = (k, whole)
                cell = None if isinstance(mod, torch.nn.Embedding) else _tp_forward_cell(name, mod)
                if cell is None and isinstance(mod, torch.nn.Linear) and not weights.shards[k].info.is_full:
                    raise ValueError(f"es.member_batch: {name} is sharded but has no tensor-parallel forward to add "
                                     f"the members' terms in; use parallel.tp=1 or es.member_batch=false")
                if cell is not None:
                    cells[mod] = cell
        missing = [weights.shards[k].info.name for k in set(by_tensor.values()) - {k for k, _ in self.modules.values()}]
        if missing:
            raise ValueError(f"es.member_batch: {len(missing)} low-rank matrices are not the weight of an nn.Linear "
                             f"or nn.Embedding, so one batch cannot play them (first: {missing[0]}); exclude them "
                             f"(es.exclude) or set es.member_batch=false")
        self.rows: torch.Tensor | None = None  # per batch row, its member's slot (-1: the base weights)
        self._a: dict[tuple[int, bool], torch.Tensor] = {}  # (shard, whole) -> [rows of A, G r]: the members' A
        self._b: dict[tuple[int, bool], torch.Tensor] = {}  # (shard, whole) -> [rows of B, G r]
        self._c: torch.Tensor | None = None  # [G] coefficients sign_i sigma / sqrt(r)
        self._mask: torch.Tensor | None = None  # [R, G r]: c_i on the r columns of each row's member, else 0
        self._masks: dict = {}
        whole = sorted({k for k, w in self.modules.values() if w})
        self._whole = (whole, lowrank.FactorBank(
            [ShardInfo.full(weights.shards[k].info.name, weights.shards[k].info.global_shape) for k in whole],
            weights.rank, weights.shards[whole[0]].tensor.device)) if whole else None
        self._hooks, self._cells = [], []
        for mod in self.modules:  # everything checked above: nothing is installed on a model that is then refused
            cell = cells.get(mod)
            if cell is None:
                self._hooks.append(mod.register_forward_hook(self._hook))
            else:  # inside transformers' TP forward: the local output, before its reduction or gather
                inner = cell.cell_contents
                cell.cell_contents = self._inside(mod, inner)
                self._cells.append((cell, inner))

    def set_members(self, seeds, signs, sigma: float) -> None:
        """Slots 0..G-1 are these members (their factors made once: G (m + n) r numbers per matrix)."""
        r = self.weights.rank
        every = [self.weights.factors(s) for s in seeds]  # {shard: (A, B)} per member, one kernel call each
        wholes = [dict(zip(self._whole[0], self._whole[1].factors(s))) for s in seeds] if self._whole else []
        for k, whole in set(self.modules.values()):
            dt = self.weights.shards[k].tensor.dtype
            fs = [f[k] for f in (wholes if whole else every)]
            self._a[k, whole] = torch.cat([a for a, _ in fs], 1).to(dt)
            self._b[k, whole] = torch.cat([b for _, b in fs], 1).to(dt)
        self._c = torch.tensor([g * sigma * lowrank.scale(r) for g in signs])
        self.rows, self._mask, self._masks = None, None, {}

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
        self._masks = {}  # the mask on each (device, dtype) the forwards ask for: copied once per batch of rows

    def _inside(self, mod, inner):
        def forward(*args, **kwargs):
            return self._add(mod, args[0], inner(*args, **kwargs))
        return forward

    def _hook(self, mod, args, out):
        return self._add(mod, args[0], out)

    def _add(self, mod, x, out):
        if self.rows is None:
            return out
        if hasattr(out, "to_local"):
            raise RuntimeError("members in one batch at tp > 1 play under torch.no_grad() (a local output, not a "
                               "DTensor, inside the tensor-parallel forward)")
        key = self.modules[mod]
        if x.shape[0] != self.rows.numel():
            raise RuntimeError(f"a batch of {x.shape[0]} rows, {self.rows.numel()} member slots set")
        mask = self._masks.get((out.device, out.dtype))
        if mask is None:
            mask = self._masks[out.device, out.dtype] = self._mask.to(device=out.device, dtype=out.dtype)
        a, b = self._a[key], self._b[key]  # [rows of A, G r], [rows of B, G r]
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
        for cell, inner in self._cells:
            cell.cell_contents = inner
        self._hooks, self._cells = [], []
        self.rows = None
