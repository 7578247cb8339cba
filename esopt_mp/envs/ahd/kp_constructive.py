"""0-1 knapsack, constructive: ``select_next_item(remaining_capacity, weights, values) -> index or None``.

As in the paper's evaluator: each call gets the remaining capacity (a float) and the weights and the values
of the items not taken yet, in their original order; the answer is cast with ``int`` and is an index into
those arrays (out of range is a failure), or None to stop. Packing stops when no remaining item fits, or when
the chosen item does not fit. Instances: shipped (n, 2) arrays, column 0 the weights and column 1 the values,
uniform in [0, 1); capacity 12.5 for 50 items and 25 for 100 and 200 (the paper's settings; ReEvo's for 50).
Objective: mean packed value (higher is better); score = value. The settings' seed function (always index 0)
is, by its own comment, not a usable heuristic; the reference is greedy value/weight among the items that fit.
"""
from __future__ import annotations

import numpy as np

from esopt_mp.envs.ahd.common import Caller, Failure, Problem, arr
from esopt_mp.envs.ahd.tsp_constructive import as_index

CAPACITY = {50: 12.5, 100: 25.0, 200: 25.0}
GREEDY = ("def select_next_item(remaining_capacity, weights, values):\n"
          "    ratio = np.where(weights <= remaining_capacity, values / weights, -np.inf)\n"
          "    return int(np.argmax(ratio))\n")


class KPConstructive(Problem):
    reference_thought = ("Among the items that still fit, take the one with the highest value / weight "
                         "ratio (greedy).")
    name = "kp_constructive"
    sense = "max"
    objective_key = "value"

    def reference(self):
        return GREEDY

    def fail_objective(self, instances):
        return -1.0  # below any packing (values are >= 0)

    def line_cap(self, instances):
        return 4096 + 64 * len(instances)

    def run(self, call: Caller, instances, seed):
        left = [np.arange(len(x)) for x in instances]
        cap = [CAPACITY.get(len(x), 25.0) for x in instances]
        value = [0.0 for _ in instances]
        picked = [[] for _ in instances]
        open_ = set(range(len(instances)))
        while True:
            active = [k for k in sorted(open_) if left[k].size and (instances[k][left[k], 0] <= cap[k]).any()]
            if not active:
                break
            open_ = set(active)
            calls = [[float(cap[k]), arr(instances[k][left[k], 0]), arr(instances[k][left[k], 1])] for k in active]
            for k, ans in zip(active, call.calls(calls, none=True)):
                if ans is None:  # the function stops this knapsack
                    open_.discard(k)
                    continue
                i = as_index(ans, "select_next_item")
                if not 0 <= i < left[k].size:
                    raise Failure(f"select_next_item returned index {i}, expected an index below {left[k].size}")
                item = int(left[k][i])
                w, v = instances[k][item]
                if w > cap[k]:  # the chosen item does not fit: packing stops
                    open_.discard(k)
                    continue
                cap[k] -= float(w)
                value[k] += float(v)
                picked[k].append(item)
                left[k] = np.delete(left[k], i)
        return float(np.mean(value)), {"values": value, "picked": picked}


PROBLEM = KPConstructive
