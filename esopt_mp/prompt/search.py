"""Heuristic-design outer searches whose state is the context: Sample and EoH (Liu et al., 2024).

The context is a JSON document holding the search state (Sample: the best program so far; EoH: the population,
best first), so the ledger's context versions alone replay the search. An individual is EoH's pair of a thought
(the heuristic described in one sentence, given in braces before the code) and its code, with its fitness (the
environment's score, higher is better; only programs that ran without error enter; a reply without a thought
enters by fitness with thought '') and ``op``, the operator and step that made it (``e1@3``). ``render`` turns the
state into the text injected into one episode's system prompt: Sample injects nothing (repeated prompting with
the task's own prompt, keeping the best), EoH one of its four operator prompts (e1, e2 crossover; m1, m2
mutation) over parents drawn by rank from the episode's seed. As in EoH each generation (one context update)
applies every operator equally often: the operator follows from the episode's slot in the step (slot mod the
operators that apply), so a step's episodes split among them evenly (+-1).
"""
from __future__ import annotations

import json
import random

from esopt_mp.prompt.base import Program, Trajectory

SEED_THOUGHT = "The baseline heuristic given with the task."  # the seed's thought where the problem gives none
DESCRIBE = ("First, describe your new heuristic and its main steps in one sentence inside braces, like "
            "{{...}}. Next, implement it as the function the task asks for, in a ```python block.")
MANY = "I have {k} existing heuristics, each with its description, code and fitness (higher is better):\n{parents}\n"
ONE = "I have one heuristic with its description, code and fitness (higher is better):\n{parents}\n"
E1 = MANY + ("Please help me create a new heuristic that has a totally different form from the given ones.\n"
             + DESCRIBE)
E2 = MANY + ("Please help me create a new heuristic that has a totally different form from the given ones but can "
             "be motivated from them.\nFirstly, identify the common backbone idea of the given heuristics. "
             "Secondly, based on the backbone idea, describe your new heuristic and its main steps in one sentence "
             "inside braces, like {{...}}. Thirdly, implement it as the function the task asks for, in a ```python "
             "block.")
M1 = ONE + ("Please assist me in creating a new heuristic that has a different form but can be a modified version "
            "of the heuristic provided.\n" + DESCRIBE)
M2 = ONE + ("Please identify the main parameters of the heuristic and assist me in creating a new heuristic that "
            "has different parameter settings of the heuristic provided.\n" + DESCRIBE)
OPERATORS = {"e1": E1, "e2": E2, "m1": M1, "m2": M2}


def operator(n: int, slot: int) -> str:
    """The operator of the episode in ``slot`` over a population of ``n``: crossover (e1, e2) needs two
    individuals, so with fewer only m1, m2 apply; consecutive slots cycle through those that do."""
    ops = ("e1", "e2", "m1", "m2") if n >= 2 else ("m1", "m2")
    return ops[slot % len(ops)]


def _programs(trajectories: list[Trajectory]) -> list[Program]:
    return [p for t in trajectories for p in t.programs]


def _key(ind: dict) -> tuple:
    """Sort key: evaluated individuals by fitness, best first; an unevaluated seed after all of them."""
    f = ind.get("fitness")
    return (f is None, -(f if f is not None else 0.0))


def dumps(state: dict) -> str:
    return json.dumps(state, indent=1, sort_keys=True) + "\n"


def loads(text: str, method: str) -> dict:
    try:
        state = json.loads(text)
    except ValueError as e:
        raise ValueError(f"context is not a {method} search state: {e}") from None
    if not isinstance(state, dict) or state.get("method") != method:
        raise ValueError(f"context is not a {method} search state (method {state.get('method')!r})")
    return state


class SampleSearch:
    """Repeated prompting with the same prompt; the context keeps the best valid program seen."""

    name = "sample"

    def __init__(self, reference: str, seed_fitness: float | None = None, thought: str = SEED_THOUGHT):
        self.reference, self.seed_fitness, self.thought = reference, seed_fitness, thought

    def initial(self) -> str:
        return dumps({"method": self.name, "best": {"code": self.reference, "fitness": self.seed_fitness,
                                                     "op": "seed", "thought": self.thought}})

    def render(self, context: str, seed: int, slot: int) -> str:
        return ""

    def update(self, trajectories: list[Trajectory], context: str, step: int) -> str:
        state = loads(context, self.name)
        best = state["best"]
        for p in _programs(trajectories):
            if p.valid and (best.get("fitness") is None or p.score > best["fitness"]):
                best = {"code": p.code, "fitness": p.score, "op": f"sample@{step}", "thought": p.thought}
        return dumps({"method": self.name, "best": best})

    @staticmethod
    def best(context: str) -> dict:
        return loads(context, "sample")["best"]


class EoHSearch:
    """A population of ``size`` heuristics; offspring from operator prompts; survivors by fitness."""

    name = "eoh"

    def __init__(self, reference: str, size: int = 4, parents: int = 2, seed_fitness: float | None = None,
                 thought: str = SEED_THOUGHT):
        if size < 1 or parents < 2:
            raise ValueError(f"prompt.population must be >= 1 and prompt.parents >= 2, got {size}, {parents}")
        self.reference, self.size, self.parents, self.seed_fitness = reference, size, parents, seed_fitness
        self.thought = thought

    def initial(self) -> str:
        return dumps({"method": self.name, "population": [{"code": self.reference, "fitness": self.seed_fitness,
                                                           "op": "seed", "thought": self.thought}]})

    def _pick(self, pop: list[dict], k: int, rng: random.Random) -> list[dict]:
        """``k`` distinct parents, probability proportional to 1 / (rank + len(pop)) as in EoH."""
        idx, out = list(range(len(pop))), []
        for _ in range(min(k, len(pop))):
            w = [1.0 / (i + 1 + len(pop)) for i in idx]
            j = rng.choices(range(len(idx)), weights=w)[0]
            out.append(pop[idx.pop(j)])
        return out

    def render(self, context: str, seed: int, slot: int) -> str:
        """The operator prompt of the episode in ``slot`` (operator from the slot, parents from the seed)."""
        pop = loads(context, self.name)["population"]
        op = operator(len(pop), slot)
        chosen = self._pick(pop, self.parents if op.startswith("e") else 1, random.Random(seed))
        parents = "\n".join(
            f"No. {i + 1} (fitness {'not yet evaluated' if p['fitness'] is None else format(p['fitness'], '.6g')})"
            f"\nDescription: {p.get('thought') or '(none given)'}\nCode:\n```python\n{p['code'].rstrip()}\n```"
            for i, p in enumerate(chosen))
        return OPERATORS[op].format(k=len(chosen), parents=parents)

    def update(self, trajectories: list[Trajectory], context: str, step: int) -> str:
        """Offspring of the trajectories (all played ``context``: it changes only here) join the population; the
        best ``size`` survive. An offspring's ``op`` is the operator its episode's slot had in ``context``."""
        pool = list(loads(context, self.name)["population"])
        n, seen = len(pool), {p["code"] for p in pool}
        for tr in trajectories:
            op = operator(n, tr.slot) if tr.slot >= 0 else "offspring"
            for p in tr.programs:
                if p.valid and p.code not in seen:
                    seen.add(p.code)
                    pool.append({"code": p.code, "fitness": p.score, "op": f"{op}@{step}", "thought": p.thought})
        pool.sort(key=_key)  # stable: among equal fitness the older individual survives
        return dumps({"method": self.name, "population": pool[: self.size]})

    @staticmethod
    def best(context: str) -> dict:
        return loads(context, "eoh")["population"][0]


def build_optimiser(cfg, reference: str, hooks: dict | None = None, run_dir: str | None = None, rank: int = 0,
                    seed_fitness: float | None = None, seed_thought: str = ""):
    """The ``prompt.optimiser`` of a validated :class:`esopt_mp.config.PromptConfig` over a seed program.

    ``hooks``: what the run lends an optimiser that needs the model (skill: ``proposer`` and ``validate``);
    ``seed_fitness``: the seed program's evaluated fitness, so a worse first program does not replace it (None:
    unscored); ``seed_thought``: its description ('' gives :data:`SEED_THOUGHT`).
    """
    if cfg.optimiser == "skill":
        from esopt_mp.prompt.skill import build_skill

        return build_skill(cfg, hooks, run_dir, rank)
    if cfg.optimiser == "sample":
        return SampleSearch(reference, seed_fitness, seed_thought or SEED_THOUGHT)
    if cfg.optimiser == "eoh":
        return EoHSearch(reference, cfg.population, cfg.parents, seed_fitness, seed_thought or SEED_THOUGHT)
    raise ValueError(f"prompt.optimiser: no optimiser for {cfg.optimiser!r}")
