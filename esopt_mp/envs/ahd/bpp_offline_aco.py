"""Offline bin packing, ACO: ``heuristics(demand, capacity) -> (n, n)``, how well items i and j share a bin.

Instances: shipped ``demands`` (integers 20..100), bin capacity 150 (the paper's generator). The returned
matrix (maximum in (0, inf), as the paper's evaluator asserts) drives :func:`.aco.bpp`, seeded per episode.
Objective: mean relative gap of the bins used to the L1 bound ceil(sum(demand) / capacity) (lower is
better); score = -gap. Reference: the seed function (each row the demands scaled to max 1).
"""
from __future__ import annotations

import math

import numpy as np

from esopt_mp.envs.ahd import aco
from esopt_mp.envs.ahd.common import Failure, Problem, arr
from esopt_mp.envs.ahd.tsp_aco import matrix
from esopt_mp.envs.sandbox import SandboxLimits

CAPACITY = 150


def lower_bound(demand, capacity: int = CAPACITY) -> int:
    return math.ceil(sum(int(v) for v in demand) / capacity)


class BPPOfflineACO(Problem):
    reference_thought = ("Item j's attractiveness is its demand over the largest demand, whatever the "
                         "bin: larger items first.")
    name = "bpp_offline_aco"
    sense = "min"
    objective_key = "gap"
    per_task = 2
    limits = SandboxLimits(wall_s=120, cpu_s=120, output_bytes=32 << 20)
    params = {"n_ants": 20, "n_iterations": 15}

    def load(self, path):
        return list(np.load(path)["demands"].astype(np.int64))

    def fail_objective(self, instances):  # worse than one bin per item (demand >= 20: gap <= 150/20 - 1)
        return 7.5

    def line_cap(self, instances):
        return 64 + 12 * max(len(x) for x in instances) ** 2

    def run(self, call, instances, seed):
        rng = np.random.default_rng(seed)
        gaps, bins = [], []
        for dem in instances:
            heu = matrix(call, [arr(dem.copy()), CAPACITY], len(dem), "heuristics")
            if not 0 < heu.max() < np.inf:
                raise Failure("heuristics must return a matrix with a positive maximum")
            used, packing = aco.bpp(dem.astype(float), CAPACITY, heu, rng, **self.params)
            lb = lower_bound(dem)
            gaps.append((used - lb) / lb)
            bins.append(packing.tolist())
        return float(np.mean(gaps)), {"gaps": gaps, "bins": bins}


PROBLEM = BPPOfflineACO
