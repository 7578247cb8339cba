"""0-1 knapsack, constructive: ``select_next_item(remaining_capacity, weights, values) -> index``.

As in the paper's evaluator: while the lightest remaining item fits (within its tolerance ``TOL`` = 1e-3 of
the remaining capacity), the function picks an index into the remaining items' arrays; an index out of range
or an item that does not fit (within ``TOL``) is a failure. Instances: shipped
(n, 2) arrays, column 0 the weights and column 1 the values, uniform in [0, 1); capacity 12.5 for 50 items and
25 for 100 and 200 (ReEvo's generator; the paper's evaluator uses 25 for its training size 100).
Objective: mean packed value (higher is better); score = value. The settings' seed function (always index 0)
is, by its own comment, not a usable heuristic; the reference is greedy value/weight among the items that fit.
"""
from __future__ import annotations

import numpy as np

from esopt_mp.envs.ahd.common import Caller, Failure, Problem, arr

CAPACITY = {50: 12.5, 100: 25.0, 200: 25.0}
TOL = 1e-3  # the paper's evaluator's capacity tolerance
GREEDY = ("def select_next_item(remaining_capacity, weights, values):\n"
          "    ratio = np.where(weights <= remaining_capacity + 1e-3, values / weights, -np.inf)\n"
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
        while True:
            active = [k for k, x in enumerate(instances) if left[k].size and cap[k] + TOL > x[left[k], 0].min()]
            if not active:
                break
            calls = [[float(cap[k]), arr(instances[k][left[k], 0]), arr(instances[k][left[k], 1])] for k in active]
            for k, ans in zip(active, call.calls(calls)):
                flat = ans.reshape(-1)
                if flat.size != 1 or flat[0] != int(flat[0]) or not 0 <= int(flat[0]) < left[k].size:
                    raise Failure(f"select_next_item returned {flat[:4].tolist()}, expected an index below "
                                  f"{left[k].size}")
                item = int(left[k][int(flat[0])])
                w, v = instances[k][item]
                if w > cap[k] + TOL:
                    raise Failure(f"select_next_item picked an item of weight {w:.4f} with {cap[k]:.4f} left")
                cap[k] -= w
                value[k] += v
                picked[k].append(item)
                left[k] = left[k][left[k] != item]
        return float(np.mean(value)), {"values": value, "picked": picked}


PROBLEM = KPConstructive
