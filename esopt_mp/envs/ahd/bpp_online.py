"""Online bin packing (EoH): ``score(item, bins) -> priorities``; the evaluator is :mod:`esopt_mp.envs.heuristic`.

Instances are generated from the task's seed (Weibull(3, 45) sizes, capacity 100), not shipped. Objective:
mean relative gap to the L1 bound ceil(sum / capacity) (lower is better); score = -gap. Reference: best fit.
"""
from __future__ import annotations

from esopt_mp.envs.ahd.common import Result
from esopt_mp.envs.sandbox import SandboxLimits


class BPPOnline:
    name = "bpp_online"
    reference_thought = "Best fit: the item goes to the feasible bin that it leaves with the least capacity."
    sense = "min"
    objective_key = "gap"
    generated = True  # instances come from the task's seed
    limits = SandboxLimits(wall_s=30, cpu_s=30)

    def system_prompt(self) -> str:
        from esopt_mp.envs.heuristic import SYSTEM

        return SYSTEM

    def reference(self) -> str:
        from esopt_mp.envs.heuristic import SEED_HEURISTIC

        return SEED_HEURISTIC

    def generate(self, n: int, seed: int = 0) -> list[dict]:
        from esopt_mp.envs.heuristic import generate

        return generate(n, seed)

    def task_instances(self, task: dict) -> list:
        from esopt_mp.envs.heuristic import weibull_instances

        return weibull_instances(task["seed"], task.get("n_instances", 5), task.get("n_items", 500))

    def evaluate(self, code, instances, sandbox, seed=0) -> Result:
        from esopt_mp.envs.heuristic import FAIL_GAP, evaluate

        if not code:
            return Result(-FAIL_GAP, FAIL_GAP, "no code found", {"bins": []})
        gap, error, used = evaluate(code, instances, sandbox)
        return Result(-gap, gap, error, {"bins": used})

    def feedback(self, res: Result) -> str:
        return f"Gap to the lower bound: {100 * res.objective:.2f}%."


PROBLEM = BPPOnline
