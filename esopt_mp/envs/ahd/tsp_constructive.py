"""TSP, constructive: ``select_next_node(current, destination, unvisited, distance_matrix) -> node``.

As in the paper's evaluator (ReEvo / MCTS-AHD ``tsp_constructive/eval.py``): the tour starts at node 0 (also
the destination) and the function is called n-1 times with exactly the types the shipped signature states:
``current_node: int``, ``destination_node: int``, ``unvisited_nodes: set`` (of ints, the last call offers one
node) and the ``distance_matrix`` array. The settings' seed function gives every node the same score and
``min`` takes the first in the set's iteration order (ascending for small ints), so it visits the nodes in
index order 0, 1, ..., n-1. Instances: uniform
points in the unit square (``train50``, ``val{20,50,100,200}``, ``test*`` built by ``esopt_mp.data.ahd_build``).
Objective: mean closed-tour length (lower is better); score = -length.
"""
from __future__ import annotations

import math

import numpy as np

from esopt_mp.envs.ahd.common import Caller, Failure, Problem, arr, dist_matrix, range_minus, ref


def tour_length(points: np.ndarray, tour: list[int]) -> float:
    return float(sum(np.linalg.norm(points[tour[i]] - points[tour[i - 1]]) for i in range(len(tour))))


class TSPConstructive(Problem):
    reference_thought = ("Every unvisited node scores the same, so the first one is taken: a placeholder "
                         "that ignores the distances.")
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
        tours = [[0] for _ in instances]
        unvisited = [set(range(1, len(p))) for p in instances]
        for step in range(1, max(len(p) for p in instances)):
            active = [k for k, p in enumerate(instances) if step < len(p)]
            calls = [[int(tours[k][-1]), 0, range_minus(len(instances[k]), tours[k]), ref(k)] for k in active]
            for k, ans in zip(active, call.calls(calls)):
                if ans.size != 1 or ans.reshape(-1)[0] != int(ans.reshape(-1)[0]):
                    raise Failure(f"select_next_node returned {ans.reshape(-1)[:4].tolist()}, expected one node")
                node = int(ans.reshape(-1)[0])
                if node not in unvisited[k]:
                    raise Failure(f"select_next_node returned node {node}, which is visited or not a node")
                tours[k].append(node)
                unvisited[k].remove(node)
        lengths = [tour_length(p, t) for p, t in zip(instances, tours)]
        return float(np.mean(lengths)), {"lengths": lengths, "tours": tours}


PROBLEM = TSPConstructive
