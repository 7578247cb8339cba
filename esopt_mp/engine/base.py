"""What the agent loop needs of a generation engine, and the types every engine shares.

An engine holds one conversation per episode (``new_conversation``: its own sampling seed) and generates one reply
for each of a batch of conversations per call, after appending the turn's new token ids. ``hf`` (a transformers
model, :mod:`esopt_mp.engine.hf`) and ``vllm`` (:mod:`esopt_mp.engine.vllm`) implement it;
:class:`esopt_mp.engine.tp.TPEngine` replicates one over a tensor-parallel group.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

from esopt_mp.engine.sampling import SamplingParams


@dataclasses.dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish: str  # eos | stop | length
    prefill_tokens: int
    seconds: float


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


def eos_ids(tokenizer, extra=None) -> set[int]:
    """Token ids that end a reply: ChatML's <|im_end|>, <|endoftext|>, the tokenizer's eos (both engines)."""
    eos = set(extra or [])
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
