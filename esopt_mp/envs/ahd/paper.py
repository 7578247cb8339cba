"""The paper's own final programs (one per problem, shipped under ``data:ahd/paper_programs``) scored by our
evaluators beside the objectives the paper recorded for them.

Constructive problems are deterministic: one evaluation. The ACO problems depend on the colony's random
stream (the paper's torch stream is not ours), so they are scored over several seeds and compared with that
spread: mean, sample standard deviation, min and max.
"""
from __future__ import annotations

import copy
import dataclasses
import statistics

import yaml

from esopt_mp.data import data_path
from esopt_mp.envs import ahd
from esopt_mp.envs.sandbox import Sandbox, SandboxConfig

STOCHASTIC = ("tsp_aco", "cvrp_aco", "bpp_offline_aco")


@dataclasses.dataclass
class Row:
    """One (program, instance set) comparison: the paper's recorded objective and ours."""

    problem: str
    split: str
    size: int
    instances: int
    recorded: float
    ours: float  # the mean over seeds for the ACO problems
    seeds: list[int]
    sd: float = 0.0
    min: float = 0.0
    max: float = 0.0
    mode: str | None = None
    error: str | None = None

    @property
    def rel_diff(self) -> float:
        return (self.ours - self.recorded) / abs(self.recorded)


def manifest() -> dict:
    with open(data_path("ahd/paper_programs/recorded.yaml")) as f:
        return yaml.safe_load(f)


def program(problem: str) -> str:
    with open(data_path(f"ahd/paper_programs/{problem}.txt")) as f:
        return f.read()


def score(problem: str, split: str, size: int, recorded: float, seeds=(0,), first: int | None = None,
          mode: str | None = None, sandbox: Sandbox | None = None) -> Row:
    """Our objective of the paper's ``problem`` program on the split's instances (the ``first`` ones when set),
    once per seed; ``mode``: offline bin packing's ``sample`` (default) or ``aco``."""
    prob = ahd.get(problem)
    if mode is not None:
        prob = _with_mode(prob, mode)
    inst = prob.instances(split, size)[:first]
    sb = sandbox or Sandbox.from_config(SandboxConfig(), prob.limits)
    seeds = list(seeds) if problem in STOCHASTIC else [0]
    xs, error = [], None
    for s in seeds:
        r = prob.evaluate(program(problem), inst, sb, seed=s)
        if r.error:
            error = r.error
        xs.append(r.objective)
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return Row(problem, split, size, len(inst), float(recorded), statistics.mean(xs), seeds, sd, min(xs), max(xs),
               getattr(prob, "mode", None), error)


def _with_mode(prob, mode: str):
    """A copy of the problem object that plays ``mode`` (the shared one from :func:`ahd.get` is left as it is)."""
    other = copy.copy(prob)
    other.mode = mode
    return other


def table(seeds=(0, 1, 2, 3, 4), first: int | None = None, bpp_modes=("sample",), problems=None) -> list[Row]:
    """Every recorded figure of the manifest (of ``problems``, default all) beside ours."""
    rows = []
    for problem, entry in manifest()["programs"].items():
        if problems is not None and problem not in problems:
            continue
        for rec in entry["recorded"]:
            modes = bpp_modes if problem == "bpp_offline_aco" else (None,)
            for mode in modes:
                rows.append(score(problem, rec["split"], rec["size"], rec["objective"], seeds, first, mode))
    return rows
