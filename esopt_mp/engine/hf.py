"""Generation engine on a transformers model (CPU or GPU, tensor-parallel or not).

Each conversation keeps its own KV/recurrent cache between turns (prefix
reuse): a turn prefills only the tokens added since the last turn, then all
live conversations decode as one batch with per-row positions, a left-padding
mask, and per-row sampling generators. A conversation leaves the batch as soon
as it stops (EOS, a stop string, or its token budget), so finished rows cost
nothing. With ``prefix_reuse=False`` every turn re-encodes the whole history
(the baseline the benchmark compares against).
"""
from __future__ import annotations

import dataclasses
import time

import torch

from esopt_mp.engine.cache import extract_row, select_rows, stack
from esopt_mp.engine.sampling import SamplingParams, sample


@dataclasses.dataclass
class Conversation:
    cid: int
    generator: torch.Generator
    ids: list[int] = dataclasses.field(default_factory=list)
    cache: object = None
    cached: int = 0  # tokens of ``ids`` already in ``cache``


@dataclasses.dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish: str  # eos | stop | length
    prefill_tokens: int
    seconds: float


@dataclasses.dataclass
class EngineStats:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    forward_calls: int = 0

    def reset(self):
        self.prefill_tokens = self.decode_tokens = self.forward_calls = 0


class HFEngine:
    def __init__(self, model, tokenizer, *, prefix_reuse: bool = True, eos_token_ids=None):
        self.model, self.tokenizer = model, tokenizer
        self.prefix_reuse = prefix_reuse
        self.device = next(model.parameters()).device
        eos = set(eos_token_ids or [])
        for tok in ("<|im_end|>", "<|endoftext|>"):
            tid = tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
                eos.add(tid)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos = eos
        self.stats = EngineStats()

    def new_conversation(self, cid: int, seed: int) -> Conversation:
        g = torch.Generator()
        g.manual_seed(seed & ((1 << 63) - 1))
        return Conversation(cid, g)

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _forward(self, ids: torch.Tensor, cache, positions: torch.Tensor, mask: torch.Tensor | None):
        self.stats.forward_calls += 1
        out = self.model(input_ids=ids.to(self.device), cache=cache, use_cache=True,
                         position_ids=positions.to(self.device),
                         attention_mask=None if mask is None else mask.to(self.device))
        logits = out.logits[:, -1]
        return logits.full_tensor() if hasattr(logits, "full_tensor") else logits

    def _prefill(self, conv: Conversation) -> torch.Tensor:
        if not (self.prefix_reuse and conv.cache is not None):
            conv.cache, conv.cached = self._new_cache(), 0
        new = conv.ids[conv.cached:]
        if not new:
            raise ValueError(f"conversation {conv.cid}: nothing to prefill")
        pos = torch.arange(conv.cached, conv.cached + len(new))[None]
        logits = self._forward(torch.tensor([new]), conv.cache, pos, None)
        self.stats.prefill_tokens += len(new)
        conv.cached = len(conv.ids)
        return logits[0]

    @torch.no_grad()
    def generate(self, convs: list[Conversation], new_ids: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Append ``new_ids`` to each conversation and generate one reply each, batched."""
        t0 = time.perf_counter()
        prefill = []
        last = []
        for conv, ids in zip(convs, new_ids):
            conv.ids.extend(ids)
            before = self.stats.prefill_tokens
            last.append(self._prefill(conv))
            prefill.append(self.stats.prefill_tokens - before)
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
                elif len(generated[i]) >= params.max_new_tokens:
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
        text = self.tokenizer.decode([t for t in ids if t not in self.eos], skip_special_tokens=False)
        for s in params.stop:
            k = text.find(s)
            if k >= 0:
                text = text[:k]
        return text
