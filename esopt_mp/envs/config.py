"""The ``env`` section: what every environment shares, and one typed section per environment (``env.<name>.*``).

Plain Python: environments import nothing of the agent, models, engine or parallel packages, nor the run config.
"""
from __future__ import annotations

import dataclasses
import os

from esopt_mp.envs.base import MAX_WORKERS
from esopt_mp.envs.registry import DEFAULT_ENV
from esopt_mp.envs.sandbox.config import SandboxConfig
from esopt_mp.typed import ConfigError, check, from_dict


def check_episode_limits(episode_timeout_s: float, max_episode_tokens: int, env_workers: int, key: str = "env") -> None:
    """An episode's wall clock, token budget and the env-call threads: the ``env`` section's and the agent loop's."""
    check(episode_timeout_s > 0, f"{key}.episode_timeout_s", f"must be > 0, got {episode_timeout_s!r}")
    check(isinstance(max_episode_tokens, int) and max_episode_tokens >= 0, f"{key}.max_episode_tokens",
          f"must be >= 0 (0 = no budget), got {max_episode_tokens!r}")
    check(isinstance(env_workers, int) and 0 <= env_workers <= MAX_WORKERS, f"{key}.env_workers",
          f"must be in [0, {MAX_WORKERS}] (0 = default), got {env_workers!r}")


@dataclasses.dataclass
class EnvConfig:
    """The ``env`` section: what every environment shares (turn and token budgets, task counts and files, the
    sandbox floor), plus one section per environment, ``env.<name>.*``, typed by that environment's own
    dataclass (:mod:`esopt_mp.envs.registry`). Only the section of ``name`` is built and validated; the
    environment module is imported when it is named, not before."""

    name: str = DEFAULT_ENV  # the embedded default's environment
    max_turns: int = 45
    max_episode_tokens: int = 0  # prompt + generated tokens per trajectory, all turns (0: no budget)
    episode_timeout_s: float = 600.0  # an episode's wall clock from reset, the batch's generation included
    env_workers: int = 0  # threads for a batch's concurrent env calls (0: cores, at least 8, at most 64)
    train_path: str | None = None  # JSONL tasks ("data:rel" = shipped data, esopt_mp.data); None: the env's source
    eval_path: str | None = None
    n_train: int = 64
    n_eval: int = 32
    episodes_per_step: int = 8
    # ES: every member samples the step's episode e with the same draws (else each its own): with sampled
    # training episodes, members' returns then differ by their perturbations rather than by their luck
    common_draws: bool = False
    eval_repeats: int = 1
    eval_temperature: float = 0.0
    task_seed: int = 0
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)  # code-running envs' isolation floor
    sections: dict = dataclasses.field(default_factory=dict)  # env name -> its section (a mapping until built)

    @classmethod
    def from_mapping(cls, data: dict, prefix: str = "env") -> "EnvConfig":
        """Generic keys typed as usual; every other key must be an environment's section (a mapping)."""
        from esopt_mp.envs.registry import moved

        own = {f.name for f in dataclasses.fields(cls)} - {"sections"}
        generic, sections = {}, {}
        for k, v in data.items():
            if k in own:
                generic[k] = v
            elif moved(k):
                raise ConfigError(f"{prefix}.{k} is now {moved(k)}" + (".*" if isinstance(v, dict) else "")
                                  + " (each environment's settings live in its own section)")
            elif isinstance(v, dict):
                sections[k] = dict(v)
            else:
                raise ConfigError(f"unknown config key '{prefix}.{k}'; known keys here: {sorted(own)}, or an "
                                  f"environment's own section {prefix}.<name>.*")
        cfg = from_dict(cls, generic, prefix, _plain=True)
        cfg.sections = sections
        return cfg

    @property
    def spec(self):
        """The named environment's :class:`~esopt_mp.envs.spec.EnvSpec` (imports it once)."""
        from esopt_mp.envs.registry import load_spec

        return load_spec(self.name)

    @property
    def section(self):
        """The named environment's own section, built from ``env.<name>.*`` over its defaults."""
        from esopt_mp.envs.registry import build_section

        s = self.sections.get(self.name)
        if not dataclasses.is_dataclass(s):
            s = self.sections[self.name] = build_section(self.spec, s, f"env.{self.name}")
        return s

    def __getattr__(self, name: str):
        """``cfg.env.<name>``: the named environment's section (``cfg.env.<name>.<key>``)."""
        if name.startswith("_") or name != self.__dict__.get("name"):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r} (an environment's section is "
                                 f"reachable as env.<env.name>, here env.{self.__dict__.get('name')})")
        return self.section

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sections"}
        d["sandbox"] = dataclasses.asdict(self.sandbox)
        for k, v in self.sections.items():
            d[k] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
        return d

    def validate(self, key: str = "env") -> None:
        from esopt_mp.envs.registry import EnvNotFound, names

        try:
            self.sandbox.validate(f"{key}.sandbox")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        shared = {f.name for f in dataclasses.fields(self)}
        check(self.name not in shared, f"{key}.name", f"{self.name!r} is a key every environment shares, not an "
              "environment (a plugin of that name cannot be used: rename its entry point)")
        builtin, plugins = names()
        unknown = sorted(set(self.sections) - set(builtin) - set(plugins) - {self.name})
        check(not unknown, f"{key}.{unknown[0] if unknown else ''}", f"no environment is named "
              f"{(unknown or [''])[0]!r} (a misspelt section?); built-in: {', '.join(builtin)}; "
              f"installed plugins: {', '.join(plugins) or 'none'}")
        try:
            spec, section = self.spec, self.section
            spec.validate(section, self, f"{key}.{self.name}")
        except EnvNotFound as e:
            raise ConfigError(f"{key}.name: {e}") from None
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for k in ("max_turns", "n_train", "n_eval", "episodes_per_step", "eval_repeats"):
            check(getattr(self, k) >= 1, f"{key}.{k}", f"must be >= 1, got {getattr(self, k)}")
        check_episode_limits(self.episode_timeout_s, self.max_episode_tokens, self.env_workers, key)
        check(self.eval_repeats == 1 or self.eval_temperature > 0, f"{key}.eval_repeats",
              f"{self.eval_repeats} samples per question with {key}.eval_temperature=0 are {self.eval_repeats} "
              f"identical greedy samples; set {key}.eval_temperature > 0 or {key}.eval_repeats=1")
        check(self.episodes_per_step <= self.n_train, f"{key}.episodes_per_step",
              f"{self.episodes_per_step} exceeds the {self.n_train} training tasks")
        from esopt_mp.data import resolve

        for k in ("train_path", "eval_path"):
            p = getattr(self, k)
            try:
                path = resolve(p)  # "data:<rel>": shipped data, or under $ESOPT_DATA
            except (FileNotFoundError, ValueError) as e:
                raise ConfigError(f"{key}.{k}: {e}") from None
            check(path is None or os.path.exists(path), f"{key}.{k}", f"no such file: {path}")
