"""The run's typed configuration: one section per Hydra group, each defined beside the component it configures.

Hydra composes YAML into a plain dict; :func:`build_config` turns it into a :class:`TrainConfig`, rejecting
unknown keys and impossible values with a message that names the dotted key -- before any process group or model
exists. Each section validates itself (``esopt_mp/es/config.py``, ``parallel/config.py``, ``engine/config.py``,
``models/config.py``, ``envs/config.py``, ``baselines/config.py``, ``prompt/config.py``, ``endpoint/config.py``);
this module composes them and checks what spans sections. Components receive their own section (``cfg.es``...),
never the whole tree. Importing it loads no torch. The config hash is :func:`esopt_mp.identity.config_hash`.
"""
from __future__ import annotations

import dataclasses
import typing

from esopt_mp.baselines.config import ALGOS, AlgoConfig
from esopt_mp.endpoint.config import EndpointConfig
from esopt_mp.engine.config import EngineConfig
from esopt_mp.envs.config import EnvConfig
from esopt_mp.es.config import ESConfig
from esopt_mp.models.config import ModelConfig
from esopt_mp.parallel.config import ParallelConfig, check_layout
from esopt_mp.prompt.config import PromptConfig
from esopt_mp.typed import ConfigError, check, from_dict

__all__ = ["ALGOS", "ConfigError", "ObjectiveConfig", "RunConfig", "TrainConfig", "build_config", "open_sections"]


MOVED = {"es.seed": "run.seed (the run seed of every trainer: ES members, tasks, episodes, evaluation)"}


def _moved(data: dict, prefix: str = "") -> None:
    """A key of :data:`MOVED` in a composed dict (YAML, a saved config) is refused, naming its new spelling."""
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else k
        if key in MOVED:
            raise ConfigError(f"{key} is now {MOVED[key]}")
        if isinstance(v, dict) and any(m.startswith(key + ".") for m in MOVED):
            _moved(v, key)


def _field_paths(cls, prefix: str = "") -> set[str]:
    """Every dotted field of dataclass ``cls`` and of the dataclasses it nests (``es.sigma.start``...)."""
    out, hints = set(), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        out.add(key)
        if dataclasses.is_dataclass(hints[f.name]):
            out |= _field_paths(hints[f.name], key)
    return out


def open_sections(overrides: list[str]) -> list[str]:
    """Hydra overrides as the config takes them: a key the composed tree may lack becomes ``++key=v``.

    Hydra's tree is struct (a key must exist to be set) and the YAML files write only what differs from the
    dataclasses' defaults, so ``key=v`` of any known field (``es.weight_decay``, ``env.sandbox.wall_s``...) and
    ``env.<name>.<key>=v`` of an environment's section (a plugin's is never in the tree) are made ``++``, and so
    is an unknown key of a section (``engine.top_pp``), which :func:`build_config` then refuses by name. A key
    that moved (:data:`MOVED`, or into an environment's section) fails here, with its new spelling."""
    from esopt_mp.envs.registry import moved

    own = {f.name for f in dataclasses.fields(EnvConfig)} - {"sections"}
    known = _field_paths(TrainConfig) - {"env.sections"}
    typed = {f.name for f in dataclasses.fields(TrainConfig)}  # a misspelt key of these is refused by the
    # config's own check, in one line naming it, not by Hydra's struct error (a screen of traceback)
    out = []
    for arg in overrides:
        key, eq, _ = arg.partition("=")
        if eq and key.startswith("+") and not key.startswith("++") and key[1:] in known:
            arg, key = arg[1:], key[1:]  # +es.population=4: the key exists (a field); set it as the user meant
        parts = key.split(".")
        if eq and key.lstrip("+~") in MOVED:
            raise ConfigError(f"{key.lstrip('+~')} is now {MOVED[key.lstrip('+~')]}")
        if eq and len(parts) >= 2 and (key in known or (parts[0] in typed and (parts[0] != "env" or parts[1] in own))):
            arg = "++" + arg
        elif eq and parts[0] == "env" and len(parts) >= 2 and parts[1] not in own:
            if moved(parts[1]):
                raise ConfigError(f"{key} is now {moved(parts[1])}" + (f".{'.'.join(parts[2:])}" if len(parts) > 2
                                  else "") + " (each environment's settings live in its own section)")
            if len(parts) == 2:
                raise ConfigError(f"{arg}: an environment's section takes keys, {key}.<key>=value")
            if len(parts) >= 3:
                arg = "++" + arg
        out.append(arg)
    return out


@dataclasses.dataclass
class ObjectiveConfig:
    name: str = "target_logprob"
    batch: int = 8
    prompt_len: int = 8
    target_len: int = 8
    seed: int = 1234
    # name=harness: an agent program plays each episode against the member's endpoint (esopt_mp/agent/harness.py)
    callable: str = ""  # "pkg.module:fn", called fn(base_url, model, task) -> float
    command: str = ""  # an argv string (no shell): OPENAI_* in its environment, the task as JSON on stdin
    concurrency: int = 8  # episodes whose harness runs at once
    tasks: str = ""  # JSONL of training tasks ("": env.name's task source)
    eval_tasks: str = ""  # JSONL of held-out tasks ("": env.name's eval split)
    timeout_s: float = 600.0  # each episode's wall clock
    failure_return: float = 0.0  # what an episode the harness failed scores
    env: list[str] = dataclasses.field(default_factory=list)  # the trainer's variables a command gets, by name
    openai_env: str = "member"  # "user": the trainer's own OPENAI_* reach a command; the member is ESOPT_* only

    @property
    def episodic(self) -> bool:
        """Whether members are scored by played episodes (``agent``: the in-process loop; ``harness``: the user's
        program against the member's endpoint), not by a function of the weights: the one place that says so."""
        from esopt_mp.objectives import EPISODIC

        return self.name in EPISODIC

    @property
    def in_process(self) -> bool:
        """Whether the in-process agent loop plays the episodes (token log-probs, trajectories, system prompt)."""
        from esopt_mp.objectives import IN_PROCESS

        return self.name in IN_PROCESS

    @property
    def served(self) -> bool:
        """Whether the user's program plays the episodes against the served member (an endpoint, its connections)."""
        from esopt_mp.objectives import SERVED

        return self.name in SERVED

    def validate(self, key: str = "objective") -> None:
        from esopt_mp.objectives import OBJECTIVES

        check(self.name in OBJECTIVES, f"{key}.name", f"unknown objective {self.name!r}; known: {sorted(OBJECTIVES)}")
        for k in ("batch", "prompt_len", "target_len"):
            check(getattr(self, k) >= 1, f"{key}.{k}", f"must be >= 1, got {getattr(self, k)}")
        if self.served:
            from esopt_mp.agent.harness_run import check_harness_config

            check_harness_config(self, key)


@dataclasses.dataclass
class RunConfig:
    dir: str = "runs/default"
    log_every: int = 1
    eval_every: int = 0  # 0: before and after training only
    checkpoint_every: int = 10
    export: bool = False  # write run.dir/export (a plain HF directory) at the end
    trajectories: bool = True  # agent objective: write run.dir/trajectories.jsonl (the members rank 0's group played)
    degenerate_steps: int = 3  # warn loudly after this many steps in a row that learned nothing
    stop_on_degenerate: bool = False  # ... and stop with an error
    keep_checkpoints: int = 2  # newest complete checkpoints kept after each save (0: keep all)
    checkpoint_async: bool = True  # write checkpoints in the background (one host copy of the local state meanwhile)
    seed: int = 0  # the run seed of every trainer: ES members' noise, tasks, episodes, evaluation streams
    loggers: list[str] = dataclasses.field(default_factory=list)  # trackers beside metrics.jsonl (esopt_mp/trackers)
    dry_run: bool = False  # check what a start checks (esopt_mp/startup.py), then exit without training

    def validate(self, key: str = "run") -> None:
        from esopt_mp.trackers import check_loggers

        check_loggers(self.loggers, f"{key}.loggers")
        check(0 <= self.seed < 2**64, f"{key}.seed", f"must be in [0, 2**64), got {self.seed}")
        check(self.degenerate_steps >= 1, f"{key}.degenerate_steps", f"must be >= 1, got {self.degenerate_steps}")
        check(self.keep_checkpoints >= 0, f"{key}.keep_checkpoints", f"must be >= 0, got {self.keep_checkpoints}")


@dataclasses.dataclass
class TrainConfig:
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    es: ESConfig = dataclasses.field(default_factory=ESConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    objective: ObjectiveConfig = dataclasses.field(default_factory=ObjectiveConfig)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    algo: AlgoConfig = dataclasses.field(default_factory=AlgoConfig)
    prompt: PromptConfig = dataclasses.field(default_factory=PromptConfig)
    endpoint: EndpointConfig = dataclasses.field(default_factory=EndpointConfig)

    def validate(self, world_size: int | None = None) -> "TrainConfig":
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                try:
                    section.validate(f.name)
                except ConfigError:
                    raise
                except ValueError as e:  # sections defined beside their component (prompt) name the key too
                    raise ConfigError(str(e)) from None
        p = self.parallel.resolve_(world_size)
        if world_size is not None:
            check_layout(p.dp, p.tp, world_size)
        if self.engine.name == "vllm":
            check(self.algo.name == "es", "engine.name",
              f"engine=vllm serves ES rollouts; algo={self.algo.name} trains through the hf engine")
            check(self.objective.episodic, "engine.name",
              f"engine=vllm plays agent episodes: needs objective=agent or harness, got {self.objective.name!r}")
        if self.prompt.optimiser == "skill":
            check(self.objective.in_process, "prompt.optimiser",
              f"skill edits the system prompt of agent episodes: needs objective=agent, got {self.objective.name!r}")
        elif self.prompt.optimiser != "none":
            check(self.objective.in_process and self.env.spec.program_search, "prompt.optimiser",
              f"{self.prompt.optimiser} searches programs: needs objective=agent and an environment whose "
              f"episodes write one program to score, got {self.objective.name!r} / {self.env.name!r}")
        if self.prompt.optimiser != "none":
            check(self.engine.name == "hf" and self.algo.name == "es", "prompt.optimiser",
              "prompt optimisers run beside ES (algo=es) with engine=hf for now")
        if self.objective.served:  # each running episode holds a connection while its batch generates
            check(self.objective.concurrency <= self.endpoint.max_connections, "objective.concurrency",
                  f"{self.objective.concurrency} episodes at once would hold more connections than "
                  f"endpoint.max_connections={self.endpoint.max_connections} lets in; lower it or raise that")
        if self.env.common_draws:  # otherwise accepted, hashed and never used
            check(self.algo.name == "es" and self.objective.episodic, "env.common_draws",
                  f"ES members' episode draws: needs algo=es with objective=agent or harness (the baselines' "
                  f"groups always draw their own), got algo={self.algo.name}, objective={self.objective.name}")
            check(self.engine.temperature > 0, "env.common_draws",
                  "greedy training episodes (engine.temperature=0) draw nothing: set engine.temperature > 0")
        if self.algo.name != "es":
            a = self.algo
            check(not self.objective.served, "objective.name",
              f"algo={a.name} needs the token log-probs of its episodes; a harness gives one return per episode: "
              "use algo=es")
            check(self.objective.in_process, "objective.name",
              f"algo={a.name} trains on agent episodes: needs objective=agent, got {self.objective.name!r}")
            check(a.tasks_per_step >= p.dp, "algo.tasks_per_step",
              f"{a.tasks_per_step} tasks cannot cover parallel.dp={p.dp} groups (tasks are split over dp)")
            check(a.tasks_per_step <= self.env.n_train, "algo.tasks_per_step",
              f"{a.tasks_per_step} exceeds the {self.env.n_train} training tasks")
            check(a.zero_stage == 0 or p.tp == 1, "algo.zero_stage",
              f"DeepSpeed ZeRO shards over data parallelism only; use parallel.tp=1, got tp={p.tp}")
            return self
        if self.es.member_batch:
            check(self.objective.in_process or (self.objective.served and self.engine.name == "hf"),
                  "es.member_batch", f"members in one batch run in episodes (the agent loop, or with engine=hf a "
                  f"harness served by the endpoint), got engine={self.engine.name}, objective={self.objective.name}")
        check(self.es.population >= p.dp, "es.population",
               f"population {self.es.population} is smaller than parallel.dp={p.dp}: some dp groups would idle")
        return self

    def to_dict(self) -> dict:
        d = {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "env"}
        d["env"] = self.env.to_dict()
        return d


def build_config(data: dict, world_size: int | None = None) -> TrainConfig:
    """Validated :class:`TrainConfig` from a composed dict (Hydra's ``defaults`` key is ignored)."""
    data = {k: v for k, v in data.items() if k not in ("defaults", "hydra")}
    _moved(data)
    return from_dict(TrainConfig, data).validate(world_size)
