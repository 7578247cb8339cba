"""What every heuristic-design problem shares: its shipped settings and splits, and the sandboxed call protocol.

The candidate code runs in the sandbox as a function server: the host sends a line of calls (numpy arrays
travel as base64 of their bytes), the sandbox answers one float64 array per call (or ``null`` where the function
returned ``None``), and nothing else crosses. The host keeps the state (tours, knapsacks, bins) and computes the
fitness itself, so nothing the code prints or does can set its fitness; a malformed answer, an exception, a
timeout or a limit is a failure with a reason. A reply may be as large as the instance needs (an n x n matrix):
its cap is derived from the instances, and the session's output cap is raised to it.
"""
from __future__ import annotations

import abc
import base64
import copy
import dataclasses
import json
import os
import re

import numpy as np
import yaml

from esopt_mp.data import data_path
from esopt_mp.envs.sandbox import Sandbox, SandboxLimits

_SPLIT_FILE = re.compile(r"^(train|val|test)(\d+)_dataset\.(npy|npz)$")

# Run in the untrusted process: the code's own prints go to stderr, replies go to a private copy of stdout.
PRELUDE = r'''
import os as _os, sys as _sys
_proto = _os.fdopen(_os.dup(1), "w")
_os.dup2(2, 1)
_sys.stdout = _sys.stderr
import numpy as np
'''
SERVER = r'''
import base64 as _b64, json as _json
_fn = None
for _n in _NAMES:
    if callable(globals().get(_n)):
        _fn = globals()[_n]
        break
if _fn is None:
    raise NameError("no function named " + " or ".join(_NAMES))
import inspect as _inspect
try:
    _SPEC = _inspect.getfullargspec(_fn)
    _ARGC, _VARARGS = len(_SPEC.args), _SPEC.varargs is not None
except TypeError:
    _ARGC, _VARARGS = -1, False
_ctx = []
def _dec(a):
    if isinstance(a, dict) and "a" in a:
        return np.frombuffer(_b64.b64decode(a["a"]), dtype=a["d"]).reshape(a["s"]).copy()
    if isinstance(a, dict) and "r" in a:
        return _ctx[a["r"]]
    if isinstance(a, dict) and "t" in a:
        return tuple(a["t"])
    return a
for _line in _sys.stdin:
    _req = _json.loads(_line)
    if "ctx" in _req:
        _ctx = [_dec(a) for a in _req["ctx"]]
        _proto.write("[]\n")
        _proto.flush()
        continue
    _out = []
    for _args in _req["calls"]:
        if isinstance(_args, dict):  # {"by_argc": {"4": [...], "2": [...]}}: the arguments its arity takes
            _v = _args["by_argc"]
            _args = _v.get(str(_ARGC)) or (_v[max(_v, key=int)] if _VARARGS else None)
            if _args is None:
                raise TypeError("the function takes %d positional arguments, expected %s" % (_ARGC, " or ".join(_v)))
        _r = _fn(*[_dec(a) for a in _args])
        if _r is None:
            _out.append(None)
            continue
        _p = np.asarray(_r, dtype="<f8")
        _out.append([_b64.b64encode(_p.tobytes()).decode(), list(_p.shape)])
    _proto.write(_json.dumps(_out) + "\n")
    _proto.flush()
'''


def arr(a: np.ndarray) -> dict:
    """A numpy array as one JSON value of the protocol."""
    a = np.ascontiguousarray(a)
    return {"a": base64.b64encode(a.tobytes()).decode(), "d": a.dtype.str, "s": list(a.shape)}


def by_argc(variants: dict[int, list]) -> dict:
    """One call whose arguments depend on how many positional parameters the function declares (the paper's
    CVRP evaluator hands four arguments to a function of four, two to a function of two)."""
    return {"by_argc": {str(k): v for k, v in variants.items()}}


def ref(i: int) -> dict:
    """An argument that names the i-th context value sent once per session (e.g. a distance matrix)."""
    return {"r": i}


class Failure(Exception):
    """A candidate's failure with its reason (shown to the model and logged)."""


class Caller:
    """Calls the candidate function inside a sandbox session; every failure raises :class:`Failure`."""

    def __init__(self, session, line_cap: int):
        self.s, self.line_cap = session, line_cap

    def _ask(self, req: dict) -> list:
        line = self.s.ask(json.dumps(req), self.line_cap)
        if line is None:
            raise Failure(self.s.failure())
        try:
            out = json.loads(line)
            ok = isinstance(out, list) and all(x is None or (
                isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], list)
                and all(isinstance(d, int) and d >= 0 for d in x[1])) for x in out)
        except Exception:  # noqa: BLE001 - untrusted line: junk, deep nesting (RecursionError), anything
            ok = False
        if not ok:
            raise Failure("malformed reply from the function")
        return out

    def context(self, values: list) -> None:
        if self._ask({"ctx": values}) != []:
            raise Failure("malformed reply from the function")

    def calls(self, calls: list, finite: bool = True, none: bool = False) -> list:
        """One float64 array per call (shape as the function returned it); ``None`` where the function returned
        None and ``none`` allows it. ``finite=False`` lets NaN / inf through (the ACO problems clean them)."""
        out = self._ask({"calls": calls})
        if len(out) != len(calls):
            raise Failure(f"the function answered {len(out)} calls, expected {len(calls)}")
        res = []
        for x in out:
            if x is None:
                if not none:
                    raise Failure("the function returned None, expected an array")
                res.append(None)
                continue
            b, shape = x
            try:
                a = np.frombuffer(base64.b64decode(b, validate=True), dtype="<f8").reshape(shape)
            except Exception:  # noqa: BLE001
                raise Failure("malformed reply from the function") from None
            if finite and not np.all(np.isfinite(a)):
                raise Failure("the function returned non-finite values")
            res.append(a)
        return res


@dataclasses.dataclass
class Result:
    """``score``: the episode's return, higher is better; ``objective``: the problem's own figure."""

    score: float
    objective: float
    error: str | None = None
    details: dict = dataclasses.field(default_factory=dict)


class Problem(abc.ABC):
    """One heuristic-design problem: settings from ``data:ahd/settings``, instances from ``data:ahd/datasets``.

    Subclasses set ``name``, ``sense`` and ``limits``, implement ``run`` (the fitness of the function on
    instances, through a :class:`Caller`) and ``fail_objective``, and may override ``load`` (the instances of a
    split file).
    """

    name = ""
    reference_thought = ""  # what the seed function does, in one sentence (EoH's thought of the seed individual)
    sense = "min"  # the objective's direction; the score (return) is always higher-is-better
    limits = SandboxLimits(wall_s=60, cpu_s=60)
    per_task = 8  # instances one episode evaluates
    objective_key = "objective"  # the objective's name in the episode info (length, value, size, cost, gap)

    def __init__(self):
        base = f"ahd/settings/prompts/{self.name}"
        with open(data_path(f"ahd/settings/cfg/problem/{self.name}.yaml")) as f:
            self.cfg = yaml.safe_load(f)
        self.prompts = {}
        for k in ("func_desc", "func_signature", "seed_func", "external_knowledge"):
            p = data_path(f"{base}/{k}.txt", must_exist=False)
            if os.path.exists(p):
                with open(p) as f:
                    self.prompts[k] = f.read().strip()
        self.func_name = self.cfg["func_name"]
        self.problem_size = int(self.cfg["problem_size"])
        self._cache: dict = {}

    # -- data -------------------------------------------------------------------------------------------------
    def splits(self) -> dict[str, list[int]]:
        """{split: sizes} as the shipped file names say (``train50_dataset.npy`` -> train, 50)."""
        out: dict[str, list[int]] = {}
        folder = data_path(f"ahd/datasets/{self.name}")
        for fn in sorted(os.listdir(folder)):
            m = _SPLIT_FILE.match(fn)
            if m:
                out.setdefault(m.group(1), []).append(int(m.group(2)))
        return {k: sorted(v) for k, v in out.items()}

    def dataset_file(self, split: str, size: int | None = None) -> str:
        size = size or self.problem_size
        ext = "npz" if self.name == "bpp_offline_aco" else "npy"
        if split not in ("train", "val", "test"):
            raise ValueError(f"env.split: must be train, val or test, got {split!r}")
        return data_path(f"ahd/datasets/{self.name}/{split}{size}_dataset.{ext}")

    def instances(self, split: str = "train", size: int | None = None) -> list:
        return self.load(self.dataset_file(split, size))

    def load(self, path: str) -> list:
        return list(np.load(path))

    def task_instances(self, task: dict) -> list:
        key = (task.get("split", "train"), task.get("size"))
        if key not in self._cache:
            self._cache[key] = self.instances(*key)
        data = self._cache[key]
        return [data[i] for i in task.get("indices", range(len(data)))]

    # -- prompt -----------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Accepted function names: the settings' name and the versioned names of its templates (``_v1``)."""
        return [self.func_name] + [f"{self.func_name}_v{i}" for i in (1, 2, 3)]

    def reference(self) -> str:
        """The settings' seed function (the reference heuristic where it is meaningful)."""
        return self.prompts["seed_func"] + "\n"

    def system_prompt(self) -> str:
        sig = self.prompts["func_signature"].replace("_v{version}", "")
        extra = self.prompts.get("external_knowledge")
        return (f"{self.cfg['description'].strip()}\n{self.prompts['func_desc']}\nWrite a Python function\n{sig}\n"
                "numpy is imported as np." + (f"\nHints:\n{extra}" if extra else "")
                + " Reply with the function in a ```python block.")

    # -- evaluation -------------------------------------------------------------------------------------------
    def evaluate(self, code: str, instances: list, sandbox: Sandbox, seed: int = 0) -> Result:
        fail = Result(self.to_score(self.fail_objective(instances)), self.fail_objective(instances))
        if not re.search(rf"def\s+({'|'.join(map(re.escape, self.names()))})\s*\(", code or ""):
            return dataclasses.replace(fail, error=f"no `def {self.func_name}(...)` found")
        server = f"_NAMES = {self.names()!r}\n" + SERVER
        cap = self.line_cap(instances)
        with with_reply_room(sandbox, cap).session(PRELUDE + code + "\n" + server) as s:
            try:
                objective, details = self.run(Caller(s, cap), instances, seed)
                error = None
            except Failure as e:
                error = str(e)
        if error is not None:
            if s.result is not None and s.result.error and "stopped answering" in error:
                error = s.result.error  # the limit that stopped it, not just that it stopped
            return dataclasses.replace(fail, error=error)
        return Result(self.to_score(objective), objective, None, details)

    def feedback(self, res: Result) -> str:
        better = "lower" if self.sense == "min" else "higher"
        return f"Mean {self.objective_key} on the instances: {res.objective:.4f} ({better} is better)."

    def line_cap(self, instances: list) -> int:
        return 1 << 20

    @abc.abstractmethod
    def fail_objective(self, instances: list) -> float:
        """The objective a failed candidate scores: worse than any valid answer on ``instances``."""

    def to_score(self, objective: float) -> float:
        return -objective if self.sense == "min" else objective

    @abc.abstractmethod
    def run(self, call: Caller, instances: list, seed: int) -> tuple[float, dict]:
        """(objective, details) of the candidate answering through ``call`` on ``instances``."""


def with_reply_room(sandbox: Sandbox, line_cap: int) -> Sandbox:
    """``sandbox`` with an output cap of at least one reply line plus 64 KiB (the code's own prints): a reply is
    bounded by the instance (``line_cap``), not by a generic output cap set for chat tools (64 KiB by default)."""
    need = line_cap + (64 << 10)
    if sandbox.limits.output_bytes >= need:
        return sandbox
    roomy = copy.copy(sandbox)
    roomy.limits = dataclasses.replace(sandbox.limits, output_bytes=need)
    return roomy


def dist_matrix(points: np.ndarray) -> np.ndarray:
    return np.sqrt(((points[:, None, :] - points[None, :, :]) ** 2).sum(-1))
