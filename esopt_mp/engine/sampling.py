"""Batched logits processing and per-row sampling with per-episode generators."""
from __future__ import annotations

import dataclasses

import torch

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
