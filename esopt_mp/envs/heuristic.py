"""Automatic heuristic design: the ``heuristic`` environment.

The environment plays any problem of :mod:`esopt_mp.envs.ahd` (``env.heuristic.problem``; the default, online bin
packing as in EoH, is :mod:`esopt_mp.envs.ahd.bpp_online`). Each reply's program (:func:`extract_code`) is scored
by the problem's own evaluator in the sandbox; invalid code or answers get a clear reason and the problem's failure
score.
"""
from __future__ import annotations

import dataclasses
import re

from esopt_mp.chat.format import clean_text
from esopt_mp.chat.toolcalls import build_parser
from esopt_mp.envs.spec import EnvSpec
from esopt_mp.envs.sandbox import Sandbox, SandboxConfig, SandboxLimits

_CODE = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


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
    so the program-search prompt optimisers (``prompt.optimiser=sample|eoh``) run on it."""

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
        from esopt_mp.chat.toolcalls import build_parser

        parser = build_parser("any")
        return lambda text: extract_code(text, parser)

    def search_seed(self, section) -> tuple[str, str]:
        """The program search's seed: the problem's reference heuristic and what it does (EoH's seed thought)."""
        from esopt_mp.envs import ahd

        problem = ahd.get(section.problem)
        return problem.reference(), problem.reference_thought


SPEC = HeuristicSpec()
