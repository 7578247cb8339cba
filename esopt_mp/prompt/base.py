"""The optimiser protocol, the trajectories it reads, and the content-addressed store of context versions."""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
from typing import Protocol

from esopt_mp.runfiles import fsync_dir, run_subdir, write_atomic

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
    thought: str = ""  # the reply's one-sentence description of the heuristic (EoH's "algorithm"); '' if none

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
    slot: int = -1  # training: step + pair * episodes_per_step + episode (pair: member, or member // 2 mirrored)
    step: int = -1  # the training step that played it (-1: unknown; pending sets stored before the field)

    @classmethod
    def from_turns(cls, ret: float, turns: list[dict], member: int = -1, extract=None,
                   slot: int = -1, step: int = -1) -> "Trajectory":
        """From an agent episode's turns: a turn whose info carries a ``score`` evaluated one program.

        The program is ``info["code"]`` if the environment reports it, else ``extract(response)`` (the
        environment's own code extraction, so the text is exactly what it evaluated); its thought is the
        braced description the reply gave before that code (:func:`extract_thought`).
        """
        progs = []
        for t in turns:
            info = t.get("info") or {}
            if "score" in info:
                s = info["score"]
                text = t.get("response", "")
                code = info.get("code") or (extract(text) if extract else None) or ""
                progs.append(Program(code, float(s) if s is not None else math.nan, info.get("error"),
                                     extract_thought(text, code)))
        feedback = ["\n".join(str(m.get("content") or "") for m in (t.get("messages") or []) if isinstance(m, dict))
                    for t in turns]
        return cls(ret, [t.get("response", "") for t in turns], progs, member, feedback, slot, step)


_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
# spans whose braces are never a thought: reasoning blocks, inline code, and LaTeX maths ($...$, \(...\), \[...\])
_NOT_PROSE = re.compile(r"<think>.*?</think>|`[^`\n]*`|\$\$.*?\$\$"
                        r"|\$(?=\S)[^$\n]*?(?<=\S)\$(?!\d)"  # $x$ maths, not "$5 and $3" prices
                        r"|\\\(.*?\\\)|\\\[.*?\\\]", re.DOTALL)
_WORD = re.compile(r"[A-Za-z]{2,}")
THOUGHT_CHARS = 600  # a thought rides in every later operator prompt that picks its program: bounded


def _braced(text: str) -> list[str]:
    """The top-level ``{...}`` groups of ``text``, in order."""
    groups, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                start = i + 1
            depth += 1
        elif ch == "}" and depth > 0:
            depth -= 1
            if depth == 0:
                groups.append(text[start:i])
    return groups


def _sentence(groups: list[str]) -> str:
    """Of brace groups, the one that reads most like a sentence (most words of two letters or more; a tie: the
    later one, nearest the code); JSON objects (``{"...``) and groups without words are never one."""
    best, words = "", 0
    for g in groups:
        g = " ".join(g.split())
        n = len(_WORD.findall(g))
        if g and not g.startswith('"') and n and n >= words:
            best, words = g, n
    return best[:THOUGHT_CHARS]


def extract_thought(text: str, code: str = "") -> str:
    """The description in braces that ``text`` gives with its program ``code`` ('' if none).

    EoH asks for the new heuristic in one sentence inside braces, then its code. The text before the code is
    read first (before the fenced block holding ``code``, else before ``code`` itself, else before the first
    fence), then, if it holds no braced sentence, the text after it. Fenced blocks, inline code, LaTeX maths and
    ``<think>`` blocks are removed first, so braces inside code (dicts, sets, f-strings), formulas and drafts never
    count, nor do JSON objects (a tool call: ``{"...``). Of the remaining brace groups the most sentence-like one
    (:func:`_sentence`), whitespace-collapsed and cut to ``THOUGHT_CHARS``.
    """
    text = text or ""
    blocks = list(_FENCE.finditer(text))
    mine = [m for m in blocks if code and m.group(1).strip() == code.strip()]
    if mine:
        cut, after = mine[-1].start(), mine[-1].end()
    elif code and code.strip() and code.strip() in text:
        cut = text.index(code.strip())
        after = cut + len(code.strip())
    else:
        cut = after = blocks[0].start() if blocks else len(text)
    prose = lambda t: _NOT_PROSE.sub(" ", _FENCE.sub(" ", t).split("```")[0])  # noqa: E731 (unclosed fence: code)
    return _sentence(_braced(prose(text[:cut]))) or _sentence(_braced(prose(text[after:])))


class PromptOptimiser(Protocol):
    """Next context from the step's trajectories; deterministic, so replay may read instead of recompute."""

    name: str

    def initial(self) -> str: ...

    def update(self, trajectories: list[Trajectory], context: str, step: int) -> str: ...

    def render(self, context: str, seed: int, slot: int) -> str:
        """The text injected into the system prompt of the episode seeded ``seed`` ('' injects nothing); ``slot``:
        the episode's place, the same at every layout (training: step + pair * episodes_per_step + episode, the
        pair being the member, or member // 2 under mirrored sampling; held-out episodes: their global index), so
        an optimiser can share a step's episodes out among its prompts (EoH's operators)."""
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
            if not os.path.isdir(self.dir) or os.path.islink(self.dir):
                run_subdir(self.dir)  # a link there is refused, not written through
                fsync_dir(os.path.dirname(self.dir))  # the new folder's entry in the run directory
            write_atomic(path, text)
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


def __getattr__(name: str):
    """The protocol's former name, kept for one release (``from esopt_mp.prompt.base import ContextOptimiser``)."""
    if name == "ContextOptimiser":
        import warnings
        warnings.warn("esopt_mp.prompt.base.ContextOptimiser is now PromptOptimiser; the old name goes in the next "
                      "release", DeprecationWarning, stacklevel=2)
        return PromptOptimiser
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
