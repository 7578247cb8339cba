"""Automatic heuristic design: the ``heuristic`` environment, and online bin packing as in EoH.

The environment plays any problem of :mod:`esopt_mp.envs.ahd` (``env.heuristic.problem``); this module also holds the
online bin-packing evaluator, the default problem:

The agent writes ``score(item, bins) -> priorities`` (numpy); an item goes to
the feasible bin of highest priority. Instances are Weibull(k=3, lambda=45)
item sizes, capacity 100, drawn from the task's seed. Fitness is the mean
relative gap to the L1 lower bound ceil(sum(items) / capacity); lower is
better, and the episode's return is ``-best_gap``. The code runs in the
sandbox, which only answers score queries; the packing and the gap are computed here (see
:func:`evaluate`), and invalid code or answers get a clear reason and ``FAIL_GAP``.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import math
import re

import numpy as np

from esopt_mp.envs.toolcalls import build_parser, clean_text
from esopt_mp.envs.registry import EnvSpec
from esopt_mp.envs.sandbox import Sandbox, SandboxConfig, SandboxLimits

CAPACITY = 100
FAIL_GAP = 3.0  # worse than one bin per item (gap <= ~1.5 on these instances)
SYSTEM = ("Design a heuristic for online bin packing. Write a Python function\n"
          "def score(item: float, bins: np.ndarray) -> np.ndarray\n"
          "returning one priority per feasible bin (remaining capacities in `bins`); the item goes to the bin with "
          "the highest priority. numpy is imported as np. Reply with the function in a ```python block.")
SEED_HEURISTIC = "def score(item, bins):\n    return -(bins - item)  # best fit\n"
_CODE = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)

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


def extract_code(text: str, parser) -> str | None:
    """The reply's last ```python block, else a tool call's ``code`` text, else the reply if it defines score."""
    text = clean_text(text)  # a lone surrogate cannot reach the sandbox's pipe
    blocks = _CODE.findall(text)
    if blocks:
        return blocks[-1]
    for call in parser.parse(text):
        if isinstance(call.arguments.get("code"), str):
            return call.arguments["code"]
    return text if "def score" in text else None


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


class HeuristicEnv:
    """Heuristic design on one problem of :mod:`esopt_mp.envs.ahd` (``env.heuristic.problem``; online bin packing
    by default).

    The reply's last code block is evaluated in the sandbox on the task's instances; the episode's return is the
    best score of its turns (higher is better: -gap, -length, -cost, +value, +size).
    """

    name = "heuristic"

    def __init__(self, max_turns: int = 2, parser: str = "any", sandbox: Sandbox | SandboxConfig | None = None,
                 limits: SandboxLimits | None = None, problem: str = "bpp_online"):
        from esopt_mp.envs import ahd

        self.max_turns = max_turns
        self.parser = build_parser(parser)
        self.problem = ahd.get(problem)  # ValueError naming env.heuristic.problem and the known problems
        # a ready Sandbox, or this environment's sub-config (``env.sandbox``) applied over the problem's limits
        self.sandbox = sandbox if isinstance(sandbox, Sandbox) else Sandbox.from_config(
            sandbox, limits or self.problem.limits)
        self.task = None

    def reset(self, task: dict):
        if task.get("problem", self.problem.name) != self.problem.name:
            raise ValueError(f"task {task.get('id')} is for problem {task['problem']!r}, this env plays "
                             f"env.heuristic.problem={self.problem.name!r}")
        self.task, self.turn, self.best = task, 0, None
        self.instances = self.problem.task_instances(task)
        prompt = f"Baseline heuristic:\n```python\n{self.problem.reference()}```\nImprove on it."
        return ([{"role": "system", "content": self.problem.system_prompt()}, {"role": "user", "content": prompt}],
                {"id": task.get("id")})

    @property
    def failure_return(self) -> float:
        """What an episode the model failed (its crash, its wall clock) scores: the score of no program on the
        task's instances (the problem's failure score; no sandbox runs for it)."""
        if self.task is None:
            raise RuntimeError("failure_return before reset(): it depends on the task's instances")
        return self.problem.evaluate("", self.instances, self.sandbox).score

    def step(self, assistant_text: str):
        if self.task is None:
            raise RuntimeError("step() before reset()")
        self.turn += 1
        code = extract_code(assistant_text, self.parser)
        res = self.problem.evaluate(code or "", self.instances, self.sandbox, seed=int(self.task.get("seed", 0)))
        if not code:
            res.error = "no code found"
        if self.best is None or res.score > self.best.score:
            self.best = res
        key = self.problem.objective_key
        info = {key: res.objective, "score": res.score, "error": res.error, **res.details,
                f"best_{key}": self.best.objective, "best_score": self.best.score}
        done = self.turn >= self.max_turns
        if done:
            return [], self.best.score, True, False, info
        fb = f"Evaluation failed: {res.error}" if res.error else self.problem.feedback(res)
        return [{"role": "user", "content": fb + " Reply with an improved function."}], 0.0, False, False, info


BinPackingEnv = HeuristicEnv  # the name this environment had when it played online bin packing only


@dataclasses.dataclass
class HeuristicConfig:
    """``env.heuristic``: which design problem (:func:`esopt_mp.envs.ahd.known`)."""

    problem: str = "bpp_online"

    def validate(self, key: str = "env.heuristic") -> None:
        from esopt_mp.envs import ahd

        if self.problem not in ahd.known():
            raise ValueError(f"{key}.problem: unknown heuristic-design problem {self.problem!r}; known: {ahd.known()}")


class HeuristicSpec(EnvSpec):
    """Tasks are the problem's own splits (train for training, val held out); the episodes write one program each,
    so the program-search context optimisers (``prompt.optimiser=sample|eoh``) run on it."""

    config = HeuristicConfig
    runs_code = True
    program_search = True

    def build(self, section, *, max_turns, sandbox=None):
        return HeuristicEnv(max_turns, sandbox=sandbox, problem=section.problem)

    def make(self, sandbox=None, **kwargs):
        return HeuristicEnv(sandbox=sandbox, **kwargs)

    def tasks(self, section, split, n, seed):
        from esopt_mp.envs import ahd

        return ahd.generate_tasks(section.problem, n, seed=seed, split="train" if split == "train" else "val")

    def load(self, section, path, n):
        raise ValueError(f"env.train_path / env.eval_path: heuristic tasks are its problem's own splits "
                         f"({section.problem}), not files: unset them")

    def validate(self, section, env_cfg, key):
        super().validate(section, env_cfg, key)
        for k in ("train_path", "eval_path"):
            if getattr(env_cfg, k):
                raise ValueError(f"env.{k}: heuristic tasks are its problem's own splits ({section.problem}), not "
                                 "files: unset it")

    def task_key(self, task):
        return str(task.get("question", task.get("seed")))

    def identity(self, section):  # bpp_online, the default, keeps the hash runs had before the problem was a key
        return {} if section.problem == "bpp_online" else {"problem": section.problem}

    def program_extractor(self):
        from esopt_mp.envs.toolcalls import build_parser

        parser = build_parser("any")
        return lambda text: extract_code(text, parser)

    def search_seed(self, section) -> tuple[str, str]:
        """The program search's seed: the problem's reference heuristic and what it does (EoH's seed thought)."""
        from esopt_mp.envs import ahd

        problem = ahd.get(section.problem)
        return problem.reference(), problem.reference_thought


SPEC = HeuristicSpec()
