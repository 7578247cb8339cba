"""Admissible sets, constructive: ``priority(el, n, w) -> float`` ranks candidate vectors.

The problem has no shipped instances: its instance is the pair (n, w), here I(15, 10) as in the paper's
evaluator (the yaml's ``problem_size: 10`` is w; n = 15), built the FunSearch way: vectors of n = 3g
coordinates are g groups, each one of 7 triples ((0,0,0), (0,0,1), (0,0,2), (0,1,2), (0,2,1), (1,1,1),
(2,2,2)); the candidates are the group codes of total weight w, scored once by ``priority``; the greedy adds
the best remaining candidate and drops those it makes inadmissible; the pre-admissible set is expanded by
rotating every non-constant triple. The construction is deterministic (ties: first candidate), so the seed
is not used. Objective: the size of the expanded admissible set (higher is better); score = size.
"""
from __future__ import annotations

import itertools

import numpy as np

from esopt_mp.envs.ahd.common import Caller, Failure, Problem
from esopt_mp.envs.sandbox import SandboxLimits

TRIPLES = [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 2), (0, 2, 1), (1, 1, 1), (2, 2, 2)]
WEIGHT = np.array([0, 1, 1, 2, 2, 3, 3])
_BAD_SORTED = {(0, 0, 0), (0, 1, 1), (0, 2, 2), (0, 3, 3), (0, 4, 4), (0, 5, 5), (0, 6, 6), (1, 1, 1), (1, 1, 2),
               (1, 2, 2), (1, 2, 3), (1, 2, 4), (1, 3, 3), (1, 4, 4), (1, 5, 5), (1, 6, 6), (2, 2, 2), (2, 3, 3),
               (2, 4, 4), (2, 5, 5), (2, 6, 6), (3, 3, 3), (3, 3, 4), (3, 4, 4), (3, 4, 5), (3, 4, 6), (3, 5, 5),
               (3, 6, 6), (4, 4, 4), (4, 5, 5), (4, 6, 6), (5, 5, 5), (5, 5, 6), (5, 6, 6), (6, 6, 6)}
BAD = np.zeros((7, 7, 7), dtype=bool)  # group codes (a, b, c) that give no admissible coordinate in that group
for _t in itertools.product(range(7), repeat=3):
    BAD[_t] = tuple(sorted(_t)) in _BAD_SORTED


def candidates(n: int, w: int) -> np.ndarray:
    g = n // 3
    if 3 * g != n:
        raise ValueError(f"asp: n must be a multiple of 3, got {n}")
    codes = np.array(list(itertools.product(range(7), repeat=g)), dtype=np.int64).reshape(-1, g)
    return codes[WEIGHT[codes].sum(1) == w]


def vector(code: np.ndarray) -> tuple:
    return sum((TRIPLES[x] for x in code), ())


def greedy(codes: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """The pre-admissible set the greedy builds from candidate ``codes`` ranked by ``scores``."""
    chosen = []
    while len(codes):
        best = int(np.argmax(scores))
        e = codes[best]
        we, wc = WEIGHT[e][None, :], WEIGHT[codes]
        keep = ~((we <= wc).all(1) | (we >= wc).all(1))  # comparable vectors (the chosen one included) go
        for x in chosen:
            keep &= ~BAD[x[None, :], e[None, :], codes].all(1)
        chosen.append(e)
        codes, scores = codes[keep], scores[keep]
    return np.array(chosen)


def expand(pre: np.ndarray) -> list[tuple]:
    out = []
    for row in pre:
        rots = []
        for x in row:
            a, b, c = TRIPLES[x]
            rots.append([(a, b, c)] if a == b == c else [(a, b, c), (c, a, b), (b, c, a)])
        out += [sum(p, ()) for p in itertools.product(*rots)]
    return out


class ASPConstructive(Problem):
    reference_thought = "Every element gets the same priority 1: a placeholder without any structure."
    name = "asp_constructive"
    sense = "max"
    objective_key = "size"
    per_task = 1
    limits = SandboxLimits(wall_s=60, cpu_s=60, output_bytes=1 << 20)  # one reply: 2432 priorities, ~54 kB
    n = 15  # the paper's evaluator: I(15, 10); w is the yaml's problem_size

    def __init__(self):
        super().__init__()
        self.w = self.problem_size

    def instances(self, split="train", size=None):
        """The one instance (n, w) whatever the split: the problem is a construction, not a data set."""
        return [(self.n, size or self.w)]

    def fail_objective(self, instances):
        return -1.0

    def line_cap(self, instances):
        return 64 << 20

    def run(self, call: Caller, instances, seed):
        sizes, details = [], {}
        for n, w in instances:
            codes = candidates(n, w)
            batch = call.calls([[{"t": list(vector(c))}, n, w] for c in codes])
            wrong = next((b.shape for b in batch if b.size != 1), None)
            if wrong is not None:
                raise Failure(f"priority returned shape {wrong}, expected one number per vector")
            scores = np.array([b.reshape(-1)[0] for b in batch])
            admissible = expand(greedy(codes, scores))
            sizes.append(len(admissible))
            details = {"set": admissible}
        return float(np.mean(sizes)), {"sizes": sizes, **details}


PROBLEM = ASPConstructive
