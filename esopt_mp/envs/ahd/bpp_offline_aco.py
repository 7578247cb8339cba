"""Offline bin packing, ACO: ``heuristics(demand, capacity) -> (n, n)``, how well items i and j share a bin.

Instances: shipped ``demands`` (integers 20..100), bin capacity 150 (the paper's generator). The returned
matrix (wrong shape: a failure) is cleaned (:func:`.aco.clean`, then clipped to [1e-6, 1e6] and scaled to max 1)
and, as in the paper's evaluator, scored in ``"sample"`` mode (:func:`.aco.bpp_sample`: the fewest bins of 200
packings built from the heuristic alone); ``mode = "aco"`` runs the colony instead (:func:`.aco.bpp`, 20 ants,
15 iterations). Both are seeded per episode. Objective: mean number of bins (lower is better); score = -bins.
The gap to the L1 bound ceil(sum(demand) / capacity) is in the details. Reference: the seed function (each
row the demands scaled to max 1).
"""
from __future__ import annotations

import math

import numpy as np

from esopt_mp.envs.ahd import aco
from esopt_mp.envs.ahd.common import Problem, arr
from esopt_mp.envs.ahd.tsp_aco import matrix
from esopt_mp.envs.sandbox import SandboxLimits

CAPACITY = 150
MODES = ("sample", "aco")


def lower_bound(demand, capacity: int = CAPACITY) -> int:
    return math.ceil(sum(int(v) for v in demand) / capacity)


class BPPOfflineACO(Problem):
    reference_thought = ("Item j's attractiveness is its demand over the largest demand, whatever the "
                         "bin: larger items first.")
    name = "bpp_offline_aco"
    sense = "min"
    objective_key = "bins"
    per_task = 2
    limits = SandboxLimits(wall_s=120, cpu_s=120, output_bytes=32 << 20)
    mode = "sample"  # the paper's recorded figures; "aco": the colony
    params = {"sample": {"n_samples": 200}, "aco": {"n_ants": 20, "n_iterations": 15}}

    def load(self, path):
        return list(np.load(path)["demands"].astype(np.int64))

    def fail_objective(self, instances):  # more than one bin per item
        return float(max(len(x) for x in instances) + 1)

    def line_cap(self, instances):
        return 64 + 12 * max(len(x) for x in instances) ** 2

    def run(self, call, instances, seed):
        if self.mode not in MODES:
            raise ValueError(f"bpp_offline_aco mode: must be one of {MODES}, got {self.mode!r}")
        solve = aco.bpp_sample if self.mode == "sample" else aco.bpp
        rng = np.random.default_rng(seed)
        used, gaps, packings = [], [], []
        for dem in instances:
            heu = matrix(call, [arr(dem.copy()), CAPACITY], len(dem), "heuristics")
            n_bins, packing = solve(dem.astype(float), CAPACITY, heu, rng, **self.params[self.mode])
            lb = lower_bound(dem)
            used.append(n_bins)
            gaps.append((n_bins - lb) / lb)
            packings.append(packing.tolist())
        return float(np.mean(used)), {"bins_used": used, "gaps": gaps, "packings": packings, "mode": self.mode}


PROBLEM = BPPOfflineACO
