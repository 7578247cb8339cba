"""TSP, constructive: ``select_next_node(current, destination, candidates, distance_matrix) -> node``.

As in the paper's evaluators: the tour starts at node 0, which is also the destination; each node's neighbours
are sorted by distance (``argsort`` of its row of the full Euclidean matrix, itself excluded). At each of the
n - 2 inner steps the function gets the current node, destination 0, ``candidates`` (an int64 array: the
current node's neighbours in distance order with the visited ones removed, at most the first
:data:`NEIGHBOURS`) and the distance matrix; its answer is cast with ``int`` and must be a node not yet on
the tour (any such node, offered or not); the last node is the one left over. The settings' seed function
gives every candidate the same score and ``min`` takes the first, so it is nearest neighbour. A failure on
any instance fails the program (as in the paper's search evaluator). Instances: uniform points in the unit
square (``train50``, ``val{20,50,100,200}``; ``test{20,50,100,200}`` are written by
``python -m esopt_mp.data.ahd_build``). Objective: mean closed-tour length (lower is better); score = -length.
"""
from __future__ import annotations

import math

import numpy as np

from esopt_mp.envs.ahd.common import Caller, Failure, Problem, arr, ref

NEIGHBOURS = 50  # candidates offered per step


def tour_length(points: np.ndarray, tour: list[int]) -> float:
    return float(sum(np.linalg.norm(points[tour[i]] - points[tour[i - 1]]) for i in range(len(tour))))


def as_index(ans: np.ndarray, what: str) -> int:
    """The answer as ``int(answer)`` reads it (truncated toward zero), or a Failure."""
    flat = ans.reshape(-1)
    if flat.size != 1:
        raise Failure(f"{what} returned {flat[:4].tolist()}, expected one index")
    if not abs(flat[0]) < 2 ** 62:
        raise Failure(f"{what} returned {flat[0]!r}, expected an index")
    return int(flat[0])


class TSPConstructive(Problem):
    reference_thought = ("Every candidate scores the same, so the first one, the nearest unvisited node, is "
                         "taken: nearest neighbour.")
    name = "tsp_constructive"
    sense = "min"
    objective_key = "length"

    def fail_objective(self, instances):  # every edge of a tour in the unit square is at most sqrt(2)
        return math.sqrt(2) * max(len(p) for p in instances)

    def line_cap(self, instances):
        return 4096 + 64 * len(instances)

    def run(self, call: Caller, instances, seed):
        dists = [np.linalg.norm(p[:, None] - p[None, :], axis=2) for p in instances]
        near = [np.argsort(d, axis=1)[:, 1:].astype(np.int64) for d in dists]
        call.context([arr(d) for d in dists])
        tours = [[0] for _ in instances]
        seen = [np.zeros(len(p), dtype=bool) for p in instances]
        for s in seen:
            s[0] = True
        for step in range(1, max(len(p) for p in instances) - 1):
            active = [k for k, p in enumerate(instances) if step < len(p) - 1]
            calls = []
            for k in active:
                row = near[k][tours[k][-1]]
                cand = row[~seen[k][row]][:min(NEIGHBOURS, len(instances[k]))]
                calls.append([int(tours[k][-1]), 0, arr(cand), ref(k)])
            for k, ans in zip(active, call.calls(calls)):
                node = as_index(ans, "select_next_node")
                if not 0 <= node < len(instances[k]) or seen[k][node]:
                    raise Failure(f"select_next_node returned node {node}, which is visited or not a node")
                tours[k].append(node)
                seen[k][node] = True
        for k, s in enumerate(seen):
            tours[k] += np.nonzero(~s)[0].tolist()  # the one node left over (none for a 1-node instance)
        lengths = [tour_length(p, t) for p, t in zip(instances, tours)]
        return float(np.mean(lengths)), {"lengths": lengths, "tours": tours}


PROBLEM = TSPConstructive
