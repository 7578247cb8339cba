"""TSP, ACO: ``heuristics(distance_matrix) -> (n, n)`` edge desirabilities that steer an ant colony.

As in the paper's evaluator: the distance matrix has 1 on its diagonal, the returned matrix (wrong shape: a
failure) is cleaned (:func:`.aco.clean`: NaN -> 1e-9, +inf -> 1e9, -inf -> 1e-9, below 1e-9 -> 1e-9) and is the
colony's heuristic; :func:`.aco.tsp` with its parameters, seeded per episode.
Instances: uniform points in the unit square (train50 holds 5; val/test 20, 50, 100 hold 64).
Objective: mean best tour length (lower is better); score = -length. Reference: the seed function 1/d.
"""
from __future__ import annotations

import math

import numpy as np

from esopt_mp.envs.ahd import aco
from esopt_mp.envs.ahd.common import Caller, Failure, Problem, arr, dist_matrix
from esopt_mp.envs.sandbox import SandboxLimits


def matrix(call: Caller, args, n: int, what: str) -> np.ndarray:
    """The function's (n, n) answer to one call, non-finite values included (the colony cleans them)."""
    (heu,) = call.calls([args], finite=False)
    if heu.shape != (n, n):
        raise Failure(f"{what} returned shape {heu.shape}, expected {(n, n)}")
    return heu


class TSPACO(Problem):
    reference_thought = ("The heuristic of edge (i, j) is the inverse distance 1 / d_ij: shorter edges "
                         "are more attractive to the ants.")
    name = "tsp_aco"
    sense = "min"
    objective_key = "length"
    per_task = 5
    limits = SandboxLimits(wall_s=60, cpu_s=60, output_bytes=8 << 20)
    params = {"n_ants": 30, "n_iterations": 100}

    def fail_objective(self, instances):
        return math.sqrt(2) * max(len(p) for p in instances)

    def line_cap(self, instances):
        return 64 + 12 * max(len(p) for p in instances) ** 2

    def run(self, call, instances, seed):
        rng = np.random.default_rng(seed)
        lengths, tours = [], []
        for p in instances:
            d = dist_matrix(p)
            d[np.diag_indices_from(d)] = 1.0
            heu = matrix(call, [arr(d)], len(p), "heuristics")  # cleaned by the colony: aco.clean
            cost, tour = aco.tsp(d, heu, rng, **self.params)
            lengths.append(cost)
            tours.append(tour.tolist())
        return float(np.mean(lengths)), {"lengths": lengths, "tours": tours}


PROBLEM = TSPACO
