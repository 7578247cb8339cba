"""CVRP, ACO: ``heuristics(distance_matrix, coordinates, demands, capacity) -> (n, n)`` edge desirabilities.

Instances: shipped (n+1, 3) arrays, row 0 the depot, column 0 the demand (integers 1..9; 0 at the depot) and
columns 1-2 the coordinates in the unit square; vehicle capacity 50 (the paper's evaluator). As there, the
distance matrix has 1 on its diagonal before it is handed to the function and to the colony; a function of
four arguments gets copies of (distances, coordinates, demands, capacity), one of two gets (distances,
demands / capacity); the returned matrix, cleaned (:func:`.aco.clean`), drives :func:`.aco.cvrp`, seeded per
episode. Objective: mean best route cost, depot returns included and waiting
at the depot free (lower is better); score = -cost. Reference: the seed function 1/d.
"""
from __future__ import annotations

import math

import numpy as np

from esopt_mp.envs.ahd import aco
from esopt_mp.envs.ahd.common import Problem, arr, by_argc, dist_matrix
from esopt_mp.envs.ahd.tsp_aco import matrix
from esopt_mp.envs.sandbox import SandboxLimits

CAPACITY = 50


class CVRPACO(Problem):
    reference_thought = ("The heuristic of edge (i, j) is the inverse distance 1 / d_ij; demands and "
                         "capacity are ignored.")
    name = "cvrp_aco"
    sense = "min"
    objective_key = "cost"
    per_task = 5
    limits = SandboxLimits(wall_s=60, cpu_s=60, output_bytes=8 << 20)
    params = {"n_ants": 30, "n_iterations": 100}

    def fail_objective(self, instances):  # at most 2 edges per customer, each at most sqrt(2)
        return 2 * math.sqrt(2) * max(len(x) for x in instances)

    def line_cap(self, instances):
        return 64 + 12 * max(len(x) for x in instances) ** 2

    def run(self, call, instances, seed):
        rng = np.random.default_rng(seed)
        costs, routes = [], []
        for x in instances:
            demand, pos = x[:, 0].copy(), x[:, 1:].copy()
            d = dist_matrix(pos)
            d[np.diag_indices_from(d)] = 1.0
            args = by_argc({4: [arr(d), arr(pos), arr(demand), CAPACITY], 2: [arr(d), arr(demand / CAPACITY)]})
            heu = matrix(call, args, len(x), "heuristics")  # cleaned by the colony: aco.clean
            cost, route = aco.cvrp(d, demand, CAPACITY, heu, rng, **self.params)
            costs.append(cost)
            routes.append(route)
        return float(np.mean(costs)), {"costs": costs, "routes": routes}


PROBLEM = CVRPACO
