"""The records every layer passes along and none owns: a step's member (its seed and sign), one generation of an
engine, and one played episode. Plain data importing nothing of esopt_mp, so that the loop, the engines, the
objectives and the trainers share them without importing each other; how a record is written out is its writer's
concern (an episode's: ``agent.loop.episode_record``)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Member:
    """One member of a step, as an objective is asked to evaluate it: its seed and sign."""

    step: int
    index: int
    seed: int
    sign: int
    pair: int = -1  # mirrored sampling: index // 2 (both signs of one seed share it); -1: the index


@dataclasses.dataclass
class Generation:
    """One reply of an engine to one conversation."""

    token_ids: list[int]
    text: str
    finish: str  # eos | stop | length
    prefill_tokens: int
    seconds: float


@dataclasses.dataclass
class Episode:
    """One played trajectory: its return, how it ended, its turns (the record) and its tokens (for the baselines)."""

    id: str
    ret: float = 0.0
    ended: str = ""  # terminated | truncated | turn_budget | token_budget | failed
    turns: list = dataclasses.field(default_factory=list)
    error: str | None = None
    failure: str | None = None  # failed episodes: model | wall_clock (scored the env's failure_return) | infra (NaN)
    floor: float = 0.0  # the env's failure return: what a failed episode scores where none may be left out
    seconds: float = 0.0
    token_ids: list = dataclasses.field(default_factory=list)
    spans: list = dataclasses.field(default_factory=list)  # [start, end) of each turn's generated tokens in token_ids
    retried: str | None = None  # played again after an infrastructure failure: that first attempt's error
