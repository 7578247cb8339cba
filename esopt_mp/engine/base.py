"""What the agent loop needs of a generation engine, and what the engines share: sampling settings, token caps and
the reply's text; the batched logits processing and per-row sampling with per-episode generators of the engines
that sample in torch (hf).

An engine holds one conversation per episode (``new_conversation``: its own sampling seed) and generates one reply
for each of a batch of conversations per call, after appending the turn's new token ids. ``hf`` (a transformers
model, :mod:`esopt_mp.engine.hf`) and ``vllm`` (:mod:`esopt_mp.engine.vllm`) implement it;
:class:`esopt_mp.engine.tp.TPEngine` replicates one over a tensor-parallel group.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import torch

from esopt_mp.chat.format import build_chat_format
from esopt_mp.core.types import Generation
from esopt_mp.engine.config import EngineConfig, check_sampling


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One generation's sampling settings; the defaults are the ``engine`` section's (:class:`EngineConfig`)."""
    temperature: float = EngineConfig.temperature
    top_p: float = EngineConfig.top_p
    top_k: int = EngineConfig.top_k
    min_p: float = EngineConfig.min_p
    presence_penalty: float = EngineConfig.presence_penalty
    max_new_tokens: int = EngineConfig.max_new_tokens
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        check_sampling(self.temperature, self.top_p, self.top_k, self.min_p, self.max_new_tokens)

    @classmethod
    def of(cls, engine: EngineConfig, temperature: float | None = None) -> "SamplingParams":
        """The ``engine`` section's training sampling (``temperature``: another one, e.g. held-out evaluation's)."""
        return cls(engine.temperature if temperature is None else temperature, engine.top_p, engine.top_k,
                   engine.min_p, engine.presence_penalty, engine.max_new_tokens)


def check_caps(max_new: list[int] | None, rows: int, limit: int) -> list[int]:
    """Each row's token cap for one turn: ``min(limit, max_new[row])``; every cap must leave room for a token."""
    if max_new is None:
        return [limit] * rows
    if len(max_new) != rows or any(not isinstance(m, int) or m < 1 for m in max_new):
        raise ValueError(f"max_new must hold one int >= 1 per row ({rows}), got {max_new!r}")
    return [min(limit, m) for m in max_new]


def process_logits(logits: torch.Tensor, generated: list[list[int]], p: SamplingParams) -> torch.Tensor:
    """Presence penalty -> temperature -> min_p -> top_k -> top_p (vLLM's order); float32 [B, V]."""
    logits = logits.float().clone()
    if p.presence_penalty:
        for r, toks in enumerate(generated):
            if toks:
                logits[r, torch.tensor(sorted(set(toks)), dtype=torch.long, device=logits.device)] -= p.presence_penalty
    if p.temperature == 0:
        return logits
    logits /= p.temperature
    if p.min_p > 0:
        probs = logits.softmax(-1)
        logits[probs < p.min_p * probs.amax(-1, keepdim=True)] = -float("inf")
    if 0 < p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k, dim=-1).values[:, -1:]
        logits[logits < kth] = -float("inf")
    if p.top_p < 1:
        sorted_logits, idx = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > p.top_p  # keep the token that crosses top_p
        sorted_logits[drop] = -float("inf")
        logits = torch.full_like(logits, -float("inf")).scatter(-1, idx, sorted_logits)
    return logits


def sample(logits: torch.Tensor, generated: list[list[int]], p: SamplingParams,
           generators: list[torch.Generator]) -> list[int]:
    """One token per row; greedy at temperature 0, else from the row's own generator."""
    x = process_logits(logits, generated, p)
    if p.temperature == 0:
        return x.argmax(-1).tolist()
    probs = x.softmax(-1).cpu()
    return [int(torch.multinomial(probs[r], 1, generator=g)) for r, g in enumerate(generators)]


@dataclasses.dataclass
class EngineStats:
    prefill_tokens: int = 0  # real tokens prefilled
    decode_tokens: int = 0
    forward_calls: int = 0
    prefill_calls: int = 0
    prefill_padded_tokens: int = 0  # tokens the prefill forwards processed, padding included
    reencoded_rows: int = 0  # rows prefilled from an empty cache (first turn, no reuse, or chosen by cost)
    delta_rows: int = 0  # rows prefilled from their own cache (only the new tokens)

    def reset(self):
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)


@runtime_checkable
class Engine(Protocol):
    """A conversation is whatever the engine returns from ``new_conversation``; callers read only its ``ids`` (the
    whole token history) and hand it back to ``generate``."""

    tokenizer: Any
    pad_id: int
    stats: EngineStats
    max_context: int | None  # prompt + reply tokens a conversation may hold (None: not known)

    def new_conversation(self, cid: int, seed: int) -> Any: ...

    def generate(self, convs: list, new_ids: list[list[int]], params: SamplingParams,
                 max_new: list[int] | None = None) -> list[Generation]:
        """Append ``new_ids[i]`` to ``convs[i]`` and generate one reply each; ``max_new``: per-row caps below
        ``params.max_new_tokens`` (what an episode's token budget leaves)."""
        ...

    def close(self) -> None: ...


def generate_capped(engine: Engine, convs: list, new_ids: list[list[int]], params: SamplingParams,
                    caps: list[int] | None) -> list[Generation]:
    """One batched turn; per-row caps only when given (an engine without token budgets takes no ``max_new``)."""
    if caps is None:
        return engine.generate(convs, new_ids, params)
    return engine.generate(convs, new_ids, params, max_new=caps)


def reply_text(tokenizer, eos: set[int], ids: list[int], stop) -> str:
    """A reply's text as the environment sees it (both engines): EOS tokens dropped, cut at the first stop string."""
    text = tokenizer.decode([t for t in ids if t not in eos], skip_special_tokens=False)
    for s in stop:
        k = text.find(s)
        if k >= 0:
            text = text[:k]
    return text


def chat_stops(tokenizer) -> tuple[str, ...]:
    """Stop strings every generation gets besides its own: where the model's chat template starts the next message
    (none for ChatML, whose replies end with a token). Both engines, leader and TP peers alike, so a row ends at
    the same token on every rank."""
    return build_chat_format(tokenizer).stop


def eos_ids(tokenizer, extra=None) -> set[int]:
    """Token ids that end a reply: ChatML's <|im_end|>, <|endoftext|>, the tokenizer's eos, the special token a
    model's own chat template ends a message with (both engines)."""
    eos = set(extra or [])
    for tok in build_chat_format(tokenizer).end_tokens:
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            eos.add(tid)
    for tok in ("<|im_end|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
            eos.add(tid)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return eos


def pad_id(tokenizer) -> int:
    """The id a batch is padded with: the tokenizer's pad token, else 0."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
