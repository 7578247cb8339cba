"""The context half of a training run: which steps update what, the current context, its versions and resume.

Schedules (``prompt.mode``): ``joint`` updates the weights every step and the context every ``prompt.every``
steps from the same trajectories; ``alternate`` updates the weights on even steps and the context on odd steps;
``prompt_only`` never perturbs or updates the weights (pure prompt search: the members play the unperturbed
model with their own sampling seeds, so the number of programs evaluated stays that of an ES step).
Each ledger record carries ``context`` (the hash the step played), ``context_next`` (after the step),
``programs`` (programs evaluated) and ``valid_programs`` (of them, without error); the texts live in
``run.dir/contexts``. A context update reads every trajectory since the previous update (with ``every`` > 1 or
on ``alternate``'s ES-only steps all of them count toward the budget, so all are searched); a step that does
not update records ``pending``, the hash of its trajectories stored as JSON beside the contexts, so a resume
rebuilds the pending set exactly.
"""
from __future__ import annotations

import dataclasses
import json
import logging

from esopt_mp.prompt.base import ContextStore, Program, Trajectory
from esopt_mp.prompt.search import build_optimiser

log = logging.getLogger(__name__)
MODES = ("joint", "alternate", "prompt_only")


class PromptRun:
    def __init__(self, cfg, reference: str, run_dir: str, rank: int = 0, hooks: dict | None = None,
                 seed_fitness: float | None = None, seed_thought: str = ""):
        """``cfg``: the ``prompt`` section; ``reference``: the seed program of the environment's problem ('' for
        optimisers that need none); ``hooks``: the run's proposer / validation callables (skill synthesis);
        ``seed_fitness``: the seed program's fitness, evaluated once before the run (outside the program budget);
        ``seed_thought``: the seed program's description (heuristic search; '' gives a fixed text)."""
        self.cfg = cfg
        self.seed_fitness = seed_fitness
        self.optimiser = build_optimiser(cfg, reference, hooks, run_dir, rank, seed_fitness, seed_thought)
        self.store = ContextStore(run_dir, write=rank == 0)
        self.text = self.optimiser.initial()
        self.hash = self.store.put(self.text)
        self.initial_hash = self.hash
        self.programs = 0  # evaluated over the whole run (restored from the ledger on resume)
        self.valid = 0  # of which ran without error (the ones a search may keep)
        self.pending: list[Trajectory] = []  # trajectories since the last context update

    def es_on(self, t: int) -> bool:
        return self.cfg.mode == "joint" or (self.cfg.mode == "alternate" and t % 2 == 0)

    def ctx_on(self, t: int) -> bool:
        if self.cfg.mode == "alternate":
            return t % 2 == 1
        return (t + 1) % self.cfg.every == 0

    def render(self, seed: int, slot: int) -> str:
        """The context text of the episode seeded ``seed`` in ``slot`` (see ``PromptOptimiser.render``)."""
        return self.optimiser.render(self.text, seed, slot)

    def restore(self, entries: list[dict]) -> None:
        """The context after the ledger's last step, read from the store (not recomputed). Called with an empty
        ledger too: the optimiser may still have to trim its own records of a step the ledger never got."""
        first = entries[0].get("context") if entries else self.initial_hash
        if first != self.initial_hash:
            raise ValueError(f"the ledger's first context is {first}, this configuration starts from "
                             f"{self.initial_hash}: prompt.*, the problem's seed program or the initial context's "
                             f"format (a newer esopt_mp) changed; resume with the version that started the run, or "
                             f"start a new run.dir")
        if hasattr(self.optimiser, "restore"):  # e.g. skill synthesis: its evaluations so far, its skill.jsonl
            self.optimiser.restore(entries)
        if not entries:
            return
        self.hash = entries[-1]["context_next"]
        self.text = self.store.get(self.hash)
        self.programs = sum(int(e.get("programs", 0)) for e in entries)
        self.valid = sum(int(e.get("valid_programs", 0)) for e in entries)
        self.pending = []
        for e in entries:  # a step that updated the context consumed the pending set; one that did not added to it
            self.pending = self.pending + self._load(e["pending"]) if e.get("pending") else []
        log.info("context %s restored after step %d (%d programs evaluated so far)", self.hash,
                 entries[-1]["step"], self.programs)

    def step(self, t: int, trajectories: list[Trajectory]) -> dict:
        """Ledger fields of step ``t``; updates the context when the schedule says so."""
        n = sum(len(tr.programs) for tr in trajectories)
        ok = sum(p.valid for tr in trajectories for p in tr.programs)
        self.programs += n
        self.valid += ok
        played = self.hash
        self.pending = self.pending + list(trajectories)
        extra = {}
        if self.ctx_on(t):
            self.text = self.optimiser.update(self.pending, self.text, t)
            self.pending = []
            self.hash = self.store.put(self.text)
            if self.hash != played:
                log.info("step %d: context %s -> %s", t, played, self.hash)
            extra = self.optimiser.ledger_fields() if hasattr(self.optimiser, "ledger_fields") else {}
        else:
            extra["pending"] = self.store.put(json.dumps([dataclasses.asdict(tr) for tr in trajectories]))
        return {"context": played, "context_next": self.hash, "programs": n, "valid_programs": ok, **extra}

    def _load(self, h: str) -> list[Trajectory]:
        out = []
        for d in json.loads(self.store.get(h)):
            d["programs"] = [Program(**p) for p in d["programs"]]
            out.append(Trajectory(**d))
        return out


def __getattr__(name: str):
    """The class's former name, kept for one release."""
    if name == "ContextRun":
        import warnings
        warnings.warn("esopt_mp.prompt.run.ContextRun is now PromptRun; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return PromptRun
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
