"""Online bin packing (EoH): ``score(item, bins) -> priorities``, and its evaluator.

The agent writes ``score(item, bins) -> priorities`` (numpy); an item goes to the feasible bin of highest
priority. Instances are Weibull(k=3, lambda=45) item sizes, capacity 100, drawn from the task's seed (not shipped).
Fitness is the mean relative gap to the L1 lower bound ceil(sum(items) / capacity); lower is better, score = -gap.
The code runs in the sandbox, which only answers score queries; the packing and the gap are computed here (see
:func:`evaluate`), and invalid code or answers get a clear reason and ``FAIL_GAP``. Reference: best fit.
"""
from __future__ import annotations

import base64
import json
import math

import numpy as np

from esopt_mp.envs.ahd.common import Result
from esopt_mp.envs.sandbox import Sandbox, SandboxLimits

CAPACITY = 100
FAIL_GAP = 3.0  # worse than one bin per item (gap <= ~1.5 on these instances)
SYSTEM = ("Design a heuristic for online bin packing. Write a Python function\n"
          "def score(item: float, bins: np.ndarray) -> np.ndarray\n"
          "returning one priority per feasible bin (remaining capacities in `bins`); the item goes to the bin with "
          "the highest priority. numpy is imported as np. Reply with the function in a ```python block.")
SEED_HEURISTIC = "def score(item, bins):\n    return -(bins - item)  # best fit\n"


# Run in the untrusted process around the code: it answers score queries and nothing else. The packing and
# the gap are computed by the caller from these answers, so nothing the code prints or does can set its fitness
# (code that writes to the reply pipe itself only chooses bins, as score does, or sends a malformed reply:
# FAIL_GAP), and each query holds only the current item and the current feasible bins (no future item).
PRELUDE = r'''
import os as _os, sys as _sys
_proto = _os.fdopen(_os.dup(1), "w")
_os.dup2(2, 1)  # from here on, the code's own prints (top level included) go to stderr, not into the replies
_sys.stdout = _sys.stderr
'''
SERVER = r'''
import base64 as _b64, json as _json
import numpy as _np
for _line in _sys.stdin:
    _out = []
    for _item, _bins in _json.loads(_line):
        _b = _np.frombuffer(_b64.b64decode(_bins), dtype=_np.uint8).astype(float)
        _p = _np.asarray(score(float(_item), _b), dtype="<f8").reshape(-1)
        _out.append(_b64.b64encode(_p.tobytes()).decode())
    _proto.write(_json.dumps(_out) + "\n")
    _proto.flush()
'''

def weibull_instances(seed: int, n_instances: int = 5, n_items: int = 500) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    sizes = np.clip(np.round(45 * rng.weibull(3, size=(n_instances, n_items))), 1, CAPACITY)
    return sizes.astype(int).tolist()


def lower_bound(items: list[int], capacity: int = CAPACITY) -> int:
    return math.ceil(sum(items) / capacity)




def pack_online(instances: list[list[int]], ask) -> list[int] | str:
    """Bins used per instance when every item goes to the feasible bin that ``ask`` ranks highest.

    ``ask([[item, b64 uint8 remaining capacities of the feasible bins], ...])`` (one entry per unfinished
    instance, all at the same item index) returns one priority array per entry, or a failure reason (str).
    Any malformed answer -- wrong count or shape, non-finite values -- is a failure reason.
    """
    bins = [np.full(len(items), CAPACITY, dtype=np.int64) for items in instances]
    for t in range(max((len(i) for i in instances), default=0)):
        active = [k for k, items in enumerate(instances) if t < len(items)]
        valid = [np.nonzero(bins[k] >= instances[k][t])[0] for k in active]
        req = [[int(instances[k][t]), base64.b64encode(bins[k][v].astype(np.uint8).tobytes()).decode()]
               for k, v in zip(active, valid)]
        reply = ask(req)
        if isinstance(reply, str):
            return reply
        if len(reply) != len(active):
            return f"score answered {len(reply)} queries, expected {len(active)}"
        for k, v, pr in zip(active, valid, reply):
            if pr.shape != v.shape:
                return f"score returned shape {pr.shape}, expected {v.shape}"
            if not np.all(np.isfinite(pr)):
                return "score returned non-finite priorities"
            bins[k][v[int(np.argmax(pr))]] -= instances[k][t]
    return [int((b != CAPACITY).sum()) for b in bins]


def _decode(line: str | None) -> list[np.ndarray] | str:
    try:
        out = json.loads(line)
        if not isinstance(out, list) or not all(isinstance(x, str) for x in out):
            return "malformed reply from score"
        return [np.frombuffer(base64.b64decode(x, validate=True), dtype="<f8") for x in out]
    except Exception:  # noqa: BLE001 - the line is untrusted: deep nesting (RecursionError), junk, anything
        return "malformed reply from score"


def evaluate(code: str, instances: list[list[int]], sandbox: Sandbox) -> tuple[float, str | None, list[int]]:
    """(gap, failure reason, bins used per instance) of ``code`` on ``instances``; any failure scores FAIL_GAP."""
    if "def score" not in code:
        return FAIL_GAP, "no `def score(item, bins)` found", []
    line_cap = 64 + 12 * len(instances) * (1 + max((len(i) for i in instances), default=0))  # b64 of float64s
    with sandbox.session(PRELUDE + "import numpy as np\n" + code + "\n" + SERVER) as s:
        def ask(req):
            line = s.ask(json.dumps(req), line_cap)
            return s.failure() if line is None else _decode(line)

        used = pack_online(instances, ask)
    if isinstance(used, str):
        if s.result is not None and s.result.error and "stopped answering" in used:
            used = s.result.error
        return FAIL_GAP, used, []
    gaps = [(u - lower_bound(items)) / lower_bound(items) for u, items in zip(used, instances)]
    return float(np.mean(gaps)), None, used


def generate(n: int, seed: int = 0, n_instances: int = 5, n_items: int = 500) -> list[dict]:
    return [{"id": f"bpp-s{seed}-{i:05d}", "seed": seed * 100003 + i, "n_instances": n_instances,
             "n_items": n_items} for i in range(n)]



class BPPOnline:
    name = "bpp_online"
    reference_thought = "Best fit: the item goes to the feasible bin that it leaves with the least capacity."
    sense = "min"
    objective_key = "gap"
    generated = True  # instances come from the task's seed
    limits = SandboxLimits(wall_s=30, cpu_s=30)

    def system_prompt(self) -> str:
        return SYSTEM

    def reference(self) -> str:
        return SEED_HEURISTIC

    def generate(self, n: int, seed: int = 0) -> list[dict]:
        return generate(n, seed)

    def task_instances(self, task: dict) -> list:
        return weibull_instances(task["seed"], task.get("n_instances", 5), task.get("n_items", 500))

    def evaluate(self, code, instances, sandbox, seed=0) -> Result:
        if not code:
            return Result(-FAIL_GAP, FAIL_GAP, "no code found", {"bins": []})
        gap, error, used = evaluate(code, instances, sandbox)
        return Result(-gap, gap, error, {"bins": used})

    def feedback(self, res: Result) -> str:
        return f"Gap to the lower bound: {100 * res.objective:.2f}%."


PROBLEM = BPPOnline
