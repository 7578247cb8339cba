"""TSP, constructive: ``select_next_node(current, destination, unvisited, distance_matrix) -> node``.

As in the paper's evaluator (EoH's ``tsp_greedy``): the tour starts at node 0 (also the destination), each
step offers the unvisited nodes sorted nearest-first (a numpy array; so the settings' seed function, which
takes the first of equal scores, is nearest neighbour), the last node closes the tour. Instances: uniform
points in the unit square (``train50``, ``val{20,50,100,200}``, ``test*`` built by ``esopt_mp.data.ahd_build``).
Objective: mean closed-tour length (lower is better); score = -length.
"""
from __future__ import annotations

import math

import numpy as np

from esopt_mp.envs.ahd.common import Caller, Failure, Problem, arr, dist_matrix, ref


def tour_length(points: np.ndarray, tour: list[int]) -> float:
    return float(sum(np.linalg.norm(points[tour[i]] - points[tour[i - 1]]) for i in range(len(tour))))


class TSPConstructive(Problem):
    name = "tsp_constructive"
    sense = "min"
    objective_key = "length"

    def fail_objective(self, instances):  # every edge of a tour in the unit square is at most sqrt(2)
        return math.sqrt(2) * max(len(p) for p in instances)

    def line_cap(self, instances):
        return 4096 + 64 * len(instances)

    def run(self, call: Caller, instances, seed):
        dists = [dist_matrix(p) for p in instances]
        call.context([arr(d) for d in dists])
        order = [np.argsort(d, axis=1, kind="stable") for d in dists]
        tours = [[0] for _ in instances]
        n_max = max(len(p) for p in instances)
        for step in range(1, n_max - 1):
            active = [k for k, p in enumerate(instances) if step < len(p) - 1]
            calls, offered = [], []
            for k in active:
                seen = set(tours[k])
                near = np.array([j for j in order[k][tours[k][-1]] if j not in seen], dtype=np.int64)
                offered.append(near)
                calls.append([int(tours[k][-1]), 0, arr(near), ref(k)])
            for k, near, ans in zip(active, offered, call.calls(calls)):
                if ans.size != 1 or ans.reshape(-1)[0] != int(ans.reshape(-1)[0]):
                    raise Failure(f"select_next_node returned {ans.reshape(-1)[:4].tolist()}, expected one node")
                node = int(ans.reshape(-1)[0])
                if node not in set(near.tolist()):
                    raise Failure(f"select_next_node returned node {node}, which is visited or not a node")
                tours[k].append(node)
        for k, p in enumerate(instances):
            tours[k] += [j for j in range(len(p)) if j not in set(tours[k])]
        lengths = [tour_length(p, t) for p, t in zip(instances, tours)]
        return float(np.mean(lengths)), {"lengths": lengths, "tours": tours}


PROBLEM = TSPConstructive
