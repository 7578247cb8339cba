"""The heuristic-design problems (the paper's six and online bin packing), one small module each.

``get(name)`` returns a problem object (:class:`.common.Problem`), built once per process; the ``heuristic``
environment selects one by ``env.heuristic.problem``.
"""
from __future__ import annotations

import importlib

# problem -> module (imported on first use: each module reads its own settings)
PROBLEMS = {
    "bpp_online": "esopt_mp.envs.ahd.bpp_online",
    "tsp_constructive": "esopt_mp.envs.ahd.tsp_constructive",
    "kp_constructive": "esopt_mp.envs.ahd.kp_constructive",
    "asp_constructive": "esopt_mp.envs.ahd.asp_constructive",
    "tsp_aco": "esopt_mp.envs.ahd.tsp_aco",
    "cvrp_aco": "esopt_mp.envs.ahd.cvrp_aco",
    "bpp_offline_aco": "esopt_mp.envs.ahd.bpp_offline_aco",
}
_BUILT: dict = {}


def known() -> list[str]:
    return sorted(PROBLEMS)


def get(name: str, key: str = "env.heuristic.problem"):
    if name not in PROBLEMS:
        raise ValueError(f"{key}: unknown heuristic-design problem {name!r}; known: {known()}")
    if name not in _BUILT:
        _BUILT[name] = importlib.import_module(PROBLEMS[name]).PROBLEM()
    return _BUILT[name]


def generate_tasks(name: str, n: int, seed: int = 0, split: str = "train", size: int | None = None) -> list[dict]:
    """``n`` episodes over the split's instances, ``per_task`` consecutive instances each (cycling).

    A task names its instances (split, size, indices) and carries the seed of the solver's randomness (ACO).
    """
    prob = get(name)
    if getattr(prob, "generated", False):  # instances generated from the seed (online bin packing)
        return prob.generate(n, seed)
    total = len(prob.instances(split, size))
    k = min(prob.per_task, total)
    off = {"train": 0, "val": 1, "test": 2}[split]
    tasks = []
    for i in range(n):
        start = (i * k) % total
        idx = [(start + j) % total for j in range(k)]
        tasks.append({"id": f"{name}-{split}-s{seed}-{i:05d}", "problem": name, "split": split, "size": size,
                      "indices": idx, "seed": (seed * 3 + off) * 100003 + i})
    return tasks
