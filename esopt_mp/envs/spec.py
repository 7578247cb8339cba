"""The environment protocol the runtime talks to: :class:`EnvSpec` (one per environment; the registry in
:mod:`esopt_mp.envs.registry` finds them). Its own module, below the registry, so an environment's module imports
it without importing the registry that names that module."""
from __future__ import annotations

import abc
import dataclasses
import json


class EnvSpec(abc.ABC):
    """What the runtime knows of one environment. Subclass it for a built-in; plugins get :class:`FactorySpec`.

    ``config``: the dataclass of the ``env.<name>`` section. The methods take that section (an instance of
    ``config``) and the generic ``env`` section (``EnvConfig``: turns, task counts, paths, the sandbox) where
    they need it.
    """

    name = ""
    config: type = dataclasses.make_dataclass("NoSection", [])
    runs_code = False  # model-written code runs: the sandbox is checked at start-up
    program_search = False  # the prompt optimisers that search programs (sample, eoh) may run on it
    requires: dict[str, str] = {}
    extra: str | None = None

    @abc.abstractmethod
    def build(self, section, *, max_turns: int, sandbox=None):
        """One episode's environment."""

    @abc.abstractmethod
    def make(self, sandbox=None, **kwargs):
        """An environment from its factory's own keyword arguments (tools and tests)."""

    def tasks(self, section, split: str, n: int, seed: int) -> list[dict]:
        """``n`` tasks of ``split`` ("train" or "eval") from the environment's own source, seeded by ``seed``: what
        :meth:`splits` draws from, unless a subclass gives its fixed task sets by overriding :meth:`splits`."""
        raise TypeError(f"{type(self).__name__} overrides neither tasks() nor splits(): it has no task source")

    def load(self, section, path: str, n: int) -> list[dict]:
        """The first ``n`` tasks of a JSONL file (``env.train_path`` / ``env.eval_path``)."""
        return read_jsonl_tasks(path, n)

    def task_key(self, task: dict) -> str:
        """What makes two tasks the same (a held-out task equal to a training task is dropped)."""
        return json.dumps(task, sort_keys=True, default=str)

    def splits(self, env_cfg, section) -> tuple[list[dict], list[dict]]:
        """(train, held-out): from the files when set, else ``tasks("train", n_train, task_seed)`` and
        ``tasks("eval", 2 n_eval, task_seed + 1)``; held-out tasks equal to a training task are dropped."""
        from esopt_mp.data import resolve

        train_path, eval_path = resolve(env_cfg.train_path), resolve(env_cfg.eval_path)
        train = (self.load(section, train_path, env_cfg.n_train) if train_path
                 else self.tasks(section, "train", env_cfg.n_train, env_cfg.task_seed))
        held = (self.load(section, eval_path, env_cfg.n_eval) if eval_path
                else self.tasks(section, "eval", env_cfg.n_eval * 2, env_cfg.task_seed + 1))
        seen = {self.task_key(t) for t in train}
        drawn, held = len(held), [t for t in held if self.task_key(t) not in seen][: env_cfg.n_eval]
        if len(train) < env_cfg.episodes_per_step or not held:
            raise ValueError(f"env.name={self.name}: {len(train)} training tasks (a step plays env.episodes_per_step="
                             f"{env_cfg.episodes_per_step}) and {len(held)} held-out tasks (of {drawn} drawn, those "
                             "equal to a training task by its task_key dropped; at least 1 needed) are not enough")
        return train, held

    def validate(self, section, env_cfg, key: str) -> None:
        """The section's own checks (its ``validate(key)``) and checks against the generic ``env`` settings."""
        if hasattr(section, "validate"):
            section.validate(key)

    def check(self, section, env_cfg, first: bool) -> None:
        """Start-up check on each playing rank before any rollout (``first``: dp group 0's); the sandbox of an
        environment running code. Raise with one clear line."""
        if self.runs_code:
            from esopt_mp.envs.sandbox import Sandbox

            Sandbox.from_config(env_cfg.sandbox)

    def syncs_after_check(self, section) -> bool:
        """True when every rank must wait for the first's :meth:`check` (it resets shared state)."""
        return False

    def max_concurrent(self, section) -> int:
        """Episodes of one batch played at once (0: all)."""
        return 0

    def identity(self, section) -> dict:
        """The section's settings that shape training returns, merged into the ``env`` part of the config hash."""
        return {self.name: dataclasses.asdict(section)} if dataclasses.fields(section) else {}

    def to_dict(self, section) -> dict:
        return dataclasses.asdict(section)

    def program_extractor(self):
        """``text -> program`` of an environment whose episodes write one program (the prompt optimisers)."""
        return None


def read_jsonl_tasks(path: str, n: int | None = None, shown: str | None = None) -> list[dict]:
    """The first ``n`` (None: all) tasks of a JSONL file, one JSON object a line; a bad line is a ValueError naming
    ``shown`` (default: ``path``) and the line number."""
    shown = path if shown is None else shown
    tasks: list[dict] = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if n is not None and len(tasks) >= n:
                break
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{shown}:{i}: not a JSON task: {e}") from None
            if not isinstance(task, dict):
                raise ValueError(f"{shown}:{i}: a task must be a JSON object, got {type(task).__name__}")
            tasks.append(task)
    return tasks
