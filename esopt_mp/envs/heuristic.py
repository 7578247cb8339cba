"""Automatic heuristic design: online bin packing as in EoH.

The agent writes ``score(item, bins) -> priorities`` (numpy); an item goes to
the feasible bin of highest priority. Instances are Weibull(k=3, lambda=45)
item sizes, capacity 100, drawn from the task's seed. Fitness is the mean
relative gap to the L1 lower bound ceil(sum(items) / capacity); lower is
better, and the episode's return is ``-best_gap``. The code runs in the
sandbox with a timeout; invalid code gets a clear reason and gap 1.0.
"""
from __future__ import annotations

import json
import math
import re

import numpy as np

from esopt_mp.agent.parsers import build_parser
from esopt_mp.envs.base import register
from esopt_mp.envs.sandbox import Sandbox, SandboxLimits

CAPACITY = 100
FAIL_GAP = 3.0  # worse than one bin per item (gap <= ~1.5 on these instances)
SYSTEM = ("Design a heuristic for online bin packing. Write a Python function\n"
          "def score(item: float, bins: np.ndarray) -> np.ndarray\n"
          "returning one priority per feasible bin (remaining capacities in `bins`); the item goes to the bin with "
          "the highest priority. numpy is imported as np. Reply with the function in a ```python block.")
SEED_HEURISTIC = "def score(item, bins):\n    return -(bins - item)  # best fit\n"
_CODE = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)

HARNESS = r'''
import json, sys
import numpy as np
data = json.loads(sys.stdin.read())
used = []
for items in data["instances"]:
    cap = float(data["capacity"])
    bins = np.full(len(items), cap)
    for item in items:
        valid = np.nonzero(bins >= item)[0]
        pr = np.asarray(score(float(item), bins[valid].copy()), dtype=float).reshape(-1)
        if pr.shape != valid.shape:
            raise ValueError(f"score returned shape {pr.shape}, expected {valid.shape}")
        if not np.all(np.isfinite(pr)):
            raise ValueError("score returned non-finite priorities")
        bins[valid[int(np.argmax(pr))]] -= item
    used.append(int((bins != cap).sum()))
print(json.dumps({"bins": used}))
'''


def weibull_instances(seed: int, n_instances: int = 5, n_items: int = 500) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    sizes = np.clip(np.round(45 * rng.weibull(3, size=(n_instances, n_items))), 1, CAPACITY)
    return sizes.astype(int).tolist()


def lower_bound(items: list[int], capacity: int = CAPACITY) -> int:
    return math.ceil(sum(items) / capacity)


def extract_code(text: str, parser) -> str | None:
    blocks = _CODE.findall(text)
    if blocks:
        return blocks[-1]
    for call in parser.parse(text):
        if "code" in call.arguments:
            return call.arguments["code"]
    return text if "def score" in text else None


def evaluate(code: str, instances: list[list[int]], sandbox: Sandbox) -> tuple[float, str | None, list[int]]:
    """(gap, failure reason, bins used per instance) of ``code`` on ``instances``."""
    if "def score" not in code:
        return FAIL_GAP, "no `def score(item, bins)` found", []
    program = "import numpy as np\n" + code + "\n" + HARNESS
    res = sandbox.run_python(program, stdin=json.dumps({"instances": instances, "capacity": CAPACITY}))
    if not res.ok:
        return FAIL_GAP, res.error, []
    try:
        used = json.loads(res.stdout.strip().splitlines()[-1])["bins"]
    except (ValueError, KeyError, IndexError):
        return FAIL_GAP, "the evaluator printed no result", []
    gaps = [(u - lower_bound(items)) / lower_bound(items) for u, items in zip(used, instances)]
    return float(np.mean(gaps)), None, used


def generate(n: int, seed: int = 0, n_instances: int = 5, n_items: int = 500) -> list[dict]:
    return [{"id": f"bpp-s{seed}-{i:05d}", "seed": seed * 100003 + i, "n_instances": n_instances,
             "n_items": n_items} for i in range(n)]


@register("heuristic")
class BinPackingEnv:
    name = "heuristic"

    def __init__(self, max_turns: int = 2, parser: str = "any", sandbox: Sandbox | None = None,
                 limits: SandboxLimits | None = None):
        self.max_turns = max_turns
        self.parser = build_parser(parser)
        self.sandbox = sandbox or Sandbox(limits or SandboxLimits(wall_s=30, cpu_s=30))
        self.task = None

    def reset(self, task: dict):
        self.task, self.turn, self.best = task, 0, FAIL_GAP
        self.instances = weibull_instances(task["seed"], task.get("n_instances", 5), task.get("n_items", 500))
        prompt = f"Baseline heuristic:\n```python\n{SEED_HEURISTIC}```\nImprove on it."
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}], {"id": task.get("id")}

    def step(self, assistant_text: str):
        if self.task is None:
            raise RuntimeError("step() before reset()")
        self.turn += 1
        code = extract_code(assistant_text, self.parser)
        gap, error, used = evaluate(code, self.instances, self.sandbox) if code else (FAIL_GAP, "no code found", [])
        self.best = min(self.best, gap)
        info = {"gap": gap, "error": error, "bins": used, "best_gap": self.best}
        done = self.turn >= self.max_turns
        if done:
            return [], -self.best, True, False, info
        fb = f"Evaluation failed: {error}" if error else f"Gap to the lower bound: {100 * gap:.2f}%."
        return [{"role": "user", "content": fb + " Reply with an improved function."}], 0.0, False, False, info
