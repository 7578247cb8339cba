"""The optimiser protocol, the trajectories it reads, and the content-addressed store of context versions."""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from typing import Protocol

CONTEXTS = "contexts"  # run.dir/contexts/<hash>.txt: every context version, written once


def context_hash(text: str) -> str:
    """16 hex digits of SHA-256 of the UTF-8 text: the name the ledger records."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Program:
    """One program an episode turn submitted and the environment evaluated (``score``: higher is better)."""

    code: str
    score: float
    error: str | None = None

    @property
    def valid(self) -> bool:
        return self.error is None and bool(self.code) and math.isfinite(self.score)


@dataclasses.dataclass
class Trajectory:
    """What an optimiser sees of one episode: its return, the model's replies and the programs evaluated."""

    ret: float
    responses: list[str] = dataclasses.field(default_factory=list)
    programs: list[Program] = dataclasses.field(default_factory=list)
    member: int = -1
    feedback: list[str] = dataclasses.field(default_factory=list)  # per turn: the environment's reply messages
    step: int = -1  # the training step that played it (-1: unknown; pending sets stored before the field)

    @classmethod
    def from_turns(cls, ret: float, turns: list[dict], member: int = -1, extract=None,
                   step: int = -1) -> "Trajectory":
        """From an agent episode's turns: a turn whose info carries a ``score`` evaluated one program.

        The program is ``info["code"]`` if the environment reports it, else ``extract(response)`` (the
        environment's own code extraction, so the text is exactly what it evaluated).
        """
        progs = []
        for t in turns:
            info = t.get("info") or {}
            if "score" in info:
                s = info["score"]
                code = info.get("code") or (extract(t.get("response", "")) if extract else None) or ""
                progs.append(Program(code, float(s) if s is not None else math.nan, info.get("error")))
        feedback = ["\n".join(str(m.get("content") or "") for m in (t.get("messages") or []) if isinstance(m, dict))
                    for t in turns]
        return cls(ret, [t.get("response", "") for t in turns], progs, member, feedback, step)


class ContextOptimiser(Protocol):
    """Next context from the step's trajectories; deterministic, so replay may read instead of recompute."""

    name: str

    def initial(self) -> str: ...

    def update(self, trajectories: list[Trajectory], context: str, step: int) -> str: ...

    def render(self, context: str, seed: int) -> str:
        """The text injected into the system prompt of the episode seeded ``seed`` ('' injects nothing)."""
        ...


class ContextStore:
    """``run_dir/contexts/<hash>.txt``; a text is written once and checked against its hash when read."""

    def __init__(self, run_dir: str, write: bool = True):
        self.dir = os.path.join(run_dir, CONTEXTS)
        self.write_ok = write

    def put(self, text: str) -> str:
        h = context_hash(text)
        path = os.path.join(self.dir, f"{h}.txt")
        if self.write_ok and not os.path.exists(path):
            os.makedirs(self.dir, exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w", encoding="utf-8", newline="") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        return h

    def get(self, h: str) -> str:
        path = os.path.join(self.dir, f"{h}.txt")
        try:
            with open(path, encoding="utf-8", newline="") as f:
                text = f.read()
        except FileNotFoundError:
            raise FileNotFoundError(f"context {h} recorded in the ledger is missing: {path}") from None
        if context_hash(text) != h:
            raise ValueError(f"{path} does not hash to {h}: the context file was changed after the run wrote it")
        return text
