"""Typed configuration: every Hydra group maps onto one dataclass, validated once.

Hydra composes YAML into a plain dict; :func:`build_config` turns it into a
:class:`TrainConfig`, rejecting unknown keys and impossible values with a
message that names the dotted key -- before any process group or model exists.
Components receive their own section (``cfg.es``, ``cfg.parallel``...), never
the whole tree.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os

from esopt_mp.es.perturber import MASTER_MODES, RESTORE_MODES
from esopt_mp.es.schedules import KINDS as SCHEDULE_KINDS
from esopt_mp.es.shaping import SHAPINGS
from esopt_mp.envs.registry import DEFAULT_ENV
from esopt_mp.typed import ConfigError, from_dict
from esopt_mp.envs.sandbox.config import SandboxConfig
from esopt_mp.prompt.config import PromptConfig


ENGINES = ("hf", "vllm")


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


@dataclasses.dataclass
class ScheduleConfig:
    kind: str = "cosine"
    start: float = 1e-3
    end: float = 2.5e-4
    steps: int | None = None  # None: follow the run, end at its last step (es.steps - 1)

    def validate(self, key: str) -> None:
        _check(self.kind in SCHEDULE_KINDS, f"{key}.kind", f"must be one of {SCHEDULE_KINDS}, got {self.kind!r}")
        for k in ("start", "end"):
            v = getattr(self, k)
            _check(math.isfinite(v) and v >= 0, f"{key}.{k}", f"must be finite and >= 0, got {v}")
        _check(self.steps is None or self.steps >= 1, f"{key}.steps", f"must be >= 1, got {self.steps}")


@dataclasses.dataclass
class ESConfig:
    population: int = 8
    steps: int = 20
    seed: int = 0
    mirrored: bool = True
    sigma: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    alpha: ScheduleConfig = dataclasses.field(default_factory=lambda: ScheduleConfig("constant", 5e-4, 5e-4))
    shaping: str = "zscore"
    restore: str = "snapshot"
    master: str = "none"
    chunk_elems: int = 1 << 24
    noise_backend: str = "auto"  # esopt_mp/es/backend.py: triton on CUDA, compile for large CPU shards
    weight_decay: float = 0.0
    include: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    exclude: list[str] = dataclasses.field(default_factory=list)

    def validate(self, key: str = "es") -> None:
        _check(self.population >= 1, f"{key}.population", f"must be >= 1, got {self.population}")
        _check(not self.mirrored or self.population % 2 == 0, f"{key}.population",
               f"mirrored sampling needs an even population, got {self.population}")
        _check(self.steps >= 1, f"{key}.steps", f"must be >= 1, got {self.steps}")
        _check(0 <= self.seed < 2**64, f"{key}.seed", f"must be in [0, 2**64), got {self.seed}")
        self.sigma.validate(f"{key}.sigma")
        self.alpha.validate(f"{key}.alpha")
        _check(self.sigma.start > 0, f"{key}.sigma.start", f"a training schedule needs sigma > 0, got {self.sigma.start}")
        _check(self.shaping in SHAPINGS, f"{key}.shaping", f"must be one of {SHAPINGS}, got {self.shaping!r}")
        _check(self.restore in RESTORE_MODES, f"{key}.restore", f"must be one of {RESTORE_MODES}, got {self.restore!r}")
        _check(self.master in MASTER_MODES, f"{key}.master", f"must be one of {MASTER_MODES}, got {self.master!r}")
        _check(self.chunk_elems >= 1024, f"{key}.chunk_elems", f"must be >= 1024, got {self.chunk_elems}")
        _check(self.noise_backend in ("auto", "eager", "compile", "triton"), f"{key}.noise_backend",
               f"must be auto, eager, compile or triton, got {self.noise_backend!r}")
        _check(math.isfinite(self.weight_decay) and self.weight_decay >= 0, f"{key}.weight_decay",
               f"must be finite and >= 0, got {self.weight_decay}")


@dataclasses.dataclass
class ParallelConfig:
    dp: int = 1
    tp: int = 1
    backend: str = "auto"
    launcher: str = "auto"  # auto | deepspeed (initialise through deepspeed.init_distributed)
    checksum_every: int = 10
    timeout_s: float = 1800.0  # of every collective (init_process_group): the longest a rank may wait for the others

    def validate(self, key: str = "parallel") -> None:
        _check(self.dp >= 1, f"{key}.dp", f"must be >= 1, got {self.dp}")
        _check(self.tp >= 1, f"{key}.tp", f"must be >= 1, got {self.tp}")
        _check(self.backend in ("auto", "nccl", "gloo"), f"{key}.backend", f"must be auto, nccl or gloo, got {self.backend!r}")
        _check(self.launcher in ("auto", "deepspeed"), f"{key}.launcher", f"must be auto or deepspeed, got {self.launcher!r}")
        _check(self.checksum_every >= 0, f"{key}.checksum_every", f"must be >= 0, got {self.checksum_every}")
        _check(math.isfinite(self.timeout_s) and self.timeout_s > 0, f"{key}.timeout_s",
               f"must be a finite number of seconds > 0, got {self.timeout_s}")


@dataclasses.dataclass
class TinyModelConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    num_hidden_layers: int = 4
    intermediate_size: int = 128
    seed: int = 0
    tie_word_embeddings: bool = False  # Qwen3.5-4B is tied, 9B/27B are not: test both
    arch: str = "qwen3_5"  # qwen3_5 | qwen3
    head_dim: int = 16  # vLLM's CPU attention needs a multiple of 32

    def validate(self, key: str) -> None:
        _check(self.arch in ("qwen3_5", "qwen3"), f"{key}.arch", f"expected qwen3_5 or qwen3, got {self.arch!r}")
        _check(self.head_dim > 0 and self.head_dim % 2 == 0, f"{key}.head_dim", f"must be even and > 0, got {self.head_dim}")


@dataclasses.dataclass
class ModelConfig:
    path: str | None = None  # local HF directory; None builds the tiny model into run.dir
    dtype: str = "float32"
    tiny: TinyModelConfig = dataclasses.field(default_factory=TinyModelConfig)

    def validate(self, key: str = "model") -> None:
        _check(self.dtype in ("float32", "bfloat16", "float16"), f"{key}.dtype",
               f"must be float32, bfloat16 or float16, got {self.dtype!r}")
        self.tiny.validate(f"{key}.tiny")


@dataclasses.dataclass
class EngineConfig:
    name: str = "hf"  # hf | vllm
    prefix_reuse: bool = True  # hf: keep each conversation's KV between turns
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    min_p: float = 0.0
    presence_penalty: float = 1.5
    max_new_tokens: int = 64
    # vllm only (esopt_mp/engine/vllm.py)
    weight_sync: str = "auto"  # auto | inplace (GPU: edit vLLM's tensors) | reload (CPU: full reload_weights)
    enforce_eager: bool = True  # CUDA graphs off until tools/gpu_check.sh shows in-place edits reach them
    max_model_len: int = 0  # 0: the model's own context length
    gpu_memory_utilization: float = 0.85  # fraction of the device vLLM may take (weights + KV)
    kv_cache_gib: float = 0.0  # > 0: a fixed KV-cache budget instead (CPU default 1 GiB)

    def validate(self, key: str = "engine") -> None:
        _check(self.name in ENGINES, f"{key}.name", f"unknown engine {self.name!r}; known: {', '.join(ENGINES)}")
        _check(self.weight_sync in ("auto", "inplace", "reload"), f"{key}.weight_sync",
               f"expected auto, inplace or reload, got {self.weight_sync!r}")
        _check(0 < self.gpu_memory_utilization <= 1, f"{key}.gpu_memory_utilization",
               f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.kv_cache_gib >= 0, f"{key}.kv_cache_gib", f"must be >= 0, got {self.kv_cache_gib}")
        _check(self.max_model_len == 0 or self.max_model_len > self.max_new_tokens, f"{key}.max_model_len",
               f"must be 0 (the model's) or exceed max_new_tokens={self.max_new_tokens}, got {self.max_model_len}")
        try:
            self.sampling()
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None

    def sampling(self, temperature: float | None = None):
        from esopt_mp.engine.sampling import SamplingParams

        return SamplingParams(self.temperature if temperature is None else temperature, self.top_p, self.top_k,
                              self.min_p, self.presence_penalty, self.max_new_tokens)


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
        """The named environment's :class:`~esopt_mp.envs.registry.EnvSpec` (imports it once)."""
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
        _check(self.name not in shared, f"{key}.name", f"{self.name!r} is a key every environment shares, not an "
               "environment (a plugin of that name cannot be used: rename its entry point)")
        builtin, plugins = names()
        unknown = sorted(set(self.sections) - set(builtin) - set(plugins) - {self.name})
        _check(not unknown, f"{key}.{unknown[0] if unknown else ''}", f"no environment is named "
               f"{(unknown or [''])[0]!r} (a misspelt section?); built-in: {', '.join(builtin)}; installed plugins: {', '.join(plugins) or 'none'}")
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
            _check(getattr(self, k) >= 1, f"{key}.{k}", f"must be >= 1, got {getattr(self, k)}")
        _check(self.max_episode_tokens >= 0, f"{key}.max_episode_tokens",
               f"must be >= 0 (0 = no budget), got {self.max_episode_tokens}")
        _check(self.episode_timeout_s > 0, f"{key}.episode_timeout_s", f"must be > 0, got {self.episode_timeout_s}")
        _check(self.eval_repeats == 1 or self.eval_temperature > 0, f"{key}.eval_repeats",
               f"{self.eval_repeats} samples per question with {key}.eval_temperature=0 are {self.eval_repeats} "
               f"identical greedy samples; set {key}.eval_temperature > 0 or {key}.eval_repeats=1")
        from esopt_mp.envs.base import MAX_WORKERS

        _check(0 <= self.env_workers <= MAX_WORKERS, f"{key}.env_workers",
               f"must be in [0, {MAX_WORKERS}] (0 = default), got {self.env_workers}")
        _check(self.episodes_per_step <= self.n_train, f"{key}.episodes_per_step",
               f"{self.episodes_per_step} exceeds the {self.n_train} training tasks")
        from esopt_mp.data import resolve

        for k in ("train_path", "eval_path"):
            p = getattr(self, k)
            try:
                path = resolve(p)  # "data:<rel>": shipped data, or under $ESOPT_DATA
            except (FileNotFoundError, ValueError) as e:
                raise ConfigError(f"{key}.{k}: {e}") from None
            _check(path is None or os.path.exists(path), f"{key}.{k}", f"no such file: {path}")


def open_sections(overrides: list[str]) -> list[str]:
    """Hydra overrides with ``env.<name>.<key>=v`` made ``++env.<name>.<key>=v``: an environment's section need
    not exist in the composed tree (a plugin's never does; Hydra's tree is struct). An old spelling of a key that
    moved into a section fails here, with the new one."""
    from esopt_mp.envs.registry import moved

    own = {f.name for f in dataclasses.fields(EnvConfig)} - {"sections"}
    out = []
    for arg in overrides:
        key, eq, _ = arg.partition("=")
        parts = key.split(".")
        if eq and parts[0] == "env" and len(parts) >= 2 and parts[1] not in own:
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

    def validate(self, key: str = "objective") -> None:
        from esopt_mp.objectives import OBJECTIVES

        _check(self.name in OBJECTIVES, f"{key}.name", f"unknown objective {self.name!r}; known: {sorted(OBJECTIVES)}")
        for k in ("batch", "prompt_len", "target_len"):
            _check(getattr(self, k) >= 1, f"{key}.{k}", f"must be >= 1, got {getattr(self, k)}")


@dataclasses.dataclass
class RunConfig:
    dir: str = "runs/default"
    log_every: int = 1
    eval_every: int = 0  # 0: before and after training only
    checkpoint_every: int = 10
    export: bool = False  # write run.dir/export (a plain HF directory) at the end
    trajectories: bool = True  # agent objective: write run.dir/trajectories.jsonl (rank 0 group)
    degenerate_steps: int = 3  # warn loudly after this many steps in a row that learned nothing
    stop_on_degenerate: bool = False  # ... and stop with an error
    keep_checkpoints: int = 2  # newest complete checkpoints kept after each save (0: keep all)
    checkpoint_async: bool = True  # write checkpoints in the background (one host copy of the local state meanwhile)

    def validate(self, key: str = "run") -> None:
        _check(self.degenerate_steps >= 1, f"{key}.degenerate_steps", f"must be >= 1, got {self.degenerate_steps}")
        _check(self.keep_checkpoints >= 0, f"{key}.keep_checkpoints", f"must be >= 0, got {self.keep_checkpoints}")


ALGOS = ("es", "grpo", "ppo")


@dataclasses.dataclass
class AlgoConfig:
    """Which trainer runs (``es``, or a policy-gradient baseline) and the baselines' settings.

    Defaults: the paper's GRPO reference for Sudoku (FACTS.md: lr 1e-6, KL beta
    1e-3, clip 0.2, 8 generations, batch 32 = 4 tasks x 8). ``es`` ignores the rest.
    """
    name: str = "es"
    lr: float = 1e-6
    beta: float = 1e-3  # KL(pi || ref) weight, k3 estimator; 0: no reference model is kept
    clip: float = 0.2
    generations: int = 8  # rollouts per task (GRPO's group size)
    tasks_per_step: int = 4
    steps: int | None = None  # None: es.steps, so the same override sets both
    epochs: int = 1
    minibatch: int = 0  # episodes per optimizer step (0: the whole batch, one step per epoch)
    micro_batch: int = 0  # episodes per forward/backward (gradient accumulation; 0: = minibatch)
    max_grad_norm: float = 1.0  # 0: no clipping
    weight_decay: float = 0.0
    temperature: float = 1.0  # training rollouts' sampling temperature (greedy groups have no variance)
    grad_checkpointing: bool = False
    zero_stage: int = 0  # > 0: DeepSpeed ZeRO stage 1-3 (launch under deepspeed, tp = 1)
    adv_eps: float = 1e-4
    gamma: float = 1.0  # PPO: discount per turn
    lam: float = 0.95  # PPO: GAE lambda per turn
    vf_coef: float = 0.1
    value_clip: float = 0.2
    value_lr: float | None = None  # PPO value head's lr (None: lr)

    def validate(self, key: str = "algo") -> None:
        _check(self.name in ALGOS, f"{key}", f"unknown algorithm {self.name!r}; known: {', '.join(ALGOS)}")
        for k in ("lr", "value_clip"):
            v = getattr(self, k)
            _check(math.isfinite(v) and v > 0, f"{key}.{k}", f"must be finite and > 0, got {v}")
        _check(0 < self.clip < 1, f"{key}.clip", f"must be in (0, 1) (the ratio's range is [1-clip, 1+clip]), got {self.clip}")
        for k in ("beta", "max_grad_norm", "weight_decay", "temperature", "adv_eps", "vf_coef"):
            v = getattr(self, k)
            _check(math.isfinite(v) and v >= 0, f"{key}.{k}", f"must be finite and >= 0, got {v}")
        for k in ("gamma", "lam"):
            v = getattr(self, k)
            _check(0 <= v <= 1, f"{key}.{k}", f"must be in [0, 1], got {v}")
        for k in ("generations", "tasks_per_step", "epochs"):
            _check(getattr(self, k) >= 1, f"{key}.{k}", f"must be >= 1, got {getattr(self, k)}")
        for k in ("minibatch", "micro_batch"):
            _check(getattr(self, k) >= 0, f"{key}.{k}", f"must be >= 0 (0: whole batch), got {getattr(self, k)}")
        _check(self.steps is None or self.steps >= 1, f"{key}.steps", f"must be >= 1, got {self.steps}")
        _check(self.zero_stage in (0, 1, 2, 3), f"{key}.zero_stage", f"must be 0, 1, 2 or 3, got {self.zero_stage}")
        _check(self.value_lr is None or (math.isfinite(self.value_lr) and self.value_lr > 0), f"{key}.value_lr",
               f"must be finite and > 0, got {self.value_lr}")
        _check(self.name != "grpo" or self.generations >= 2, f"{key}.generations",
               f"GRPO needs at least 2 rollouts per task for a group advantage, got {self.generations}")
        _check(self.name == "es" or self.temperature > 0, f"{key}.temperature",
               "policy-gradient rollouts must sample (temperature > 0)")


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
        p = self.parallel
        if world_size is not None:
            _check(p.dp * p.tp == world_size, "parallel",
                   f"parallel.dp * parallel.tp must equal the world size: {p.dp} * {p.tp} = {p.dp * p.tp} != {world_size}")
        if self.engine.name == "vllm":
            _check(self.algo.name == "es", "engine.name",
                   f"engine=vllm serves ES rollouts; algo={self.algo.name} trains through the hf engine")
            _check(self.objective.name == "agent", "engine.name",
                   f"engine=vllm plays agent episodes: needs objective=agent, got {self.objective.name!r}")
        if self.prompt.optimiser == "skill":
            _check(self.objective.name == "agent", "prompt.optimiser",
                   f"skill edits the system prompt of agent episodes: needs objective=agent, got {self.objective.name!r}")
        elif self.prompt.optimiser != "none":
            _check(self.objective.name == "agent" and self.env.spec.program_search, "prompt.optimiser",
                   f"{self.prompt.optimiser} searches programs: needs objective=agent and an environment whose "
                   f"episodes write one program to score, got {self.objective.name!r} / {self.env.name!r}")
        if self.prompt.optimiser != "none":
            _check(self.engine.name == "hf" and self.algo.name == "es", "prompt.optimiser",
                   "context optimisers run beside ES (algo=es) with engine=hf for now")
        if self.algo.name != "es":
            a = self.algo
            _check(self.objective.name == "agent", "objective.name",
                   f"algo={a.name} trains on agent episodes: needs objective=agent, got {self.objective.name!r}")
            _check(a.tasks_per_step >= p.dp, "algo.tasks_per_step",
                   f"{a.tasks_per_step} tasks cannot cover parallel.dp={p.dp} groups (tasks are split over dp)")
            _check(a.tasks_per_step <= self.env.n_train, "algo.tasks_per_step",
                   f"{a.tasks_per_step} exceeds the {self.env.n_train} training tasks")
            _check(a.zero_stage == 0 or p.tp == 1, "algo.zero_stage",
                   f"DeepSpeed ZeRO shards over data parallelism only; use parallel.tp=1, got tp={p.tp}")
            return self
        _check(self.es.population >= p.dp, "es.population",
               f"population {self.es.population} is smaller than parallel.dp={p.dp}: some dp groups would idle")
        return self

    def to_dict(self) -> dict:
        d = {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "env"}
        d["env"] = self.env.to_dict()
        return d

    def hash(self, model_dir: str | None = None) -> str:
        """Hash of what determines the weights (:meth:`identity_fields`); a requeue may change anything else."""
        return _digest(self.identity_fields(model_dir))

    def identity(self, model_dir: str | None = None) -> dict:
        """{"hash": :meth:`hash`, "fields": the hashed settings as dotted keys}: stored so a refusal names them."""
        d = self.identity_fields(model_dir)
        flat: dict = {}

        def walk(prefix: str, v) -> None:
            if isinstance(v, dict):
                for k, x in v.items():
                    walk(f"{prefix}.{k}" if prefix else k, x)
            else:
                flat[prefix] = v

        walk("", d)
        return {"hash": _digest(d), "fields": flat}

    def identity_fields(self, model_dir: str | None = None) -> dict:
        """What determines the weights, as a nested dict: a requeue may change anything else (layout, eval, paths).

        In: ``es.*`` (seed, population, schedules, shaping, precision modes,
        selection), ``model.dtype``, the model by content (fingerprint of
        ``model_dir``, the resolved model directory, else of ``model.path``;
        ``model.tiny`` when the tiny model is built), ``objective.*``, the
        training tasks by content (SHA-256 of ``env.train_path``, or the
        generator settings ``n_train``/``task_seed``), the named environment's section as its spec hashes it
        (``EnvSpec.identity``; not the sections of other environments),
        every other ``env.*`` setting that shapes training returns (``max_episode_tokens`` when set: 0 keeps the
        hash of runs from before it),
        ``engine.*`` (training sampling; not vllm's memory budget, weight_sync, enforce_eager, max_model_len) and ``algo.*`` (which trainer, its lr, KL, clip...). New fields are in by default.
        Out: ``run.*`` and ``parallel.*`` (noise and updates are layout-invariant,
        tests/distributed), ``es.chunk_elems`` and ``es.noise_backend`` (bit-neutral:
        test_update_matches_dense_formula_and_chunking_is_bitwise_neutral,
        test_compiled_kernel_is_bit_identical_to_eager, test_perturb_restore_update_equal_eager), held-out evaluation
        (``env.n_eval``/``eval_path``/``eval_repeats``/``eval_temperature``:
        training tasks never depend on them), ``env.episode_timeout_s`` and ``env.env_workers`` (wall clock and
        threads: a requeue on other hardware may need other values), the sandbox's isolation level
        (``env.sandbox.level``/``min_level``: a requeue may land on a node with
        another level; the limits stay in) and every path string.
        """
        from esopt_mp.identity import file_sha256, model_fingerprint

        d = self.to_dict()
        d.pop("run")
        d.pop("parallel")
        for k in ("chunk_elems", "noise_backend"):
            d["es"].pop(k)
        eng = d["engine"]  # the engine's rollout settings; not where the weights live nor how fast it serves
        for k in ("weight_sync", "gpu_memory_utilization", "kv_cache_gib", "enforce_eager", "max_model_len"):
            eng.pop(k)
        if eng["name"] != "hf":
            eng.pop("prefix_reuse")
        tiny = d["model"]["tiny"]
        if tiny["arch"] == "qwen3_5" and tiny["head_dim"] == 16:  # the defaults: runs started before these two
            tiny.pop("arch"), tiny.pop("head_dim")  # fields existed keep their hash (and their resume)
        for k in ("n_eval", "eval_path", "eval_repeats", "eval_temperature", "episode_timeout_s", "env_workers"):
            d["env"].pop(k)  # held-out evaluation; how long / how many threads episodes may take
        if d["prompt"]["optimiser"] == "none":  # the default: runs started before prompt.* keep their hash
            d.pop("prompt")
        elif d["prompt"]["optimiser"] != "skill":  # sample / eoh runs keep the hash they had before prompt.skill
            d["prompt"].pop("skill")
        else:  # which variable holds the key and how long a request may take, not what the endpoint answers
            d["prompt"]["skill"].pop("key_env"), d["prompt"]["skill"].pop("timeout_s")
        if not self.env.max_episode_tokens:  # no budget: runs from before the field keep their hash
            d["env"].pop("max_episode_tokens")
        for k in ("level", "min_level"):  # where untrusted code may run, not what it returns
            d["env"]["sandbox"].pop(k, None)
        for k in self.env.sections:  # the named environment's section, as that environment hashes it
            d["env"].pop(k, None)
        d["env"].update(self.env.spec.identity(self.env.section))
        if self.env.train_path:
            from esopt_mp.data import resolve

            d["env"]["train_path"] = file_sha256(resolve(self.env.train_path))
        path = d["model"].pop("path")
        if path:
            d["model"].pop("tiny")
        where = model_dir or path
        if where and os.path.isdir(where):
            d["model"]["content"] = model_fingerprint(where)
        elif where:
            d["model"]["name"] = where  # "builtin:<name>" or a hub id: a name, not a filesystem path
        return d


def _digest(fields: dict) -> str:
    """The config hash of a nested dict of hashed settings (16 hex digits of a SHA-256 of its sorted JSON)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def build_config(data: dict, world_size: int | None = None) -> TrainConfig:
    """Validated :class:`TrainConfig` from a composed dict (Hydra's ``defaults`` key is ignored)."""
    data = {k: v for k, v in data.items() if k not in ("defaults", "hydra")}
    return from_dict(TrainConfig, data).validate(world_size)
