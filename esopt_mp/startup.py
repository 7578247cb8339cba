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

from esopt_mp.envs.base import StartupError

MODEL_HINT = "a local Hugging Face model directory (config.json, tokenizer files, *.safetensors)"
WEIGHTS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")


def check_run_dir(path: str) -> None:
    """``run.dir`` exists (made here) and can be written."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as e:
        raise StartupError(f"run.dir: cannot write {path} ({e.strerror or e}): set run.dir=PATH to a directory "
                           f"this user can write") from None


def model_dir(path: str | None) -> str | None:
    """``model.path`` as a directory (``builtin:NAME``: the shipped asset); None: the tiny model, built later."""
    if path and path.startswith("builtin:"):
        from esopt_mp.models.paths import ASSETS

        return os.path.join(ASSETS, path[len("builtin:"):])
    return path or None


def check_model_dir(path: str | None) -> str:
    """``model.path`` names a model directory; what it is, for the dry run's report."""
    d = model_dir(path)
    if d is None:
        return "model: the tiny model (model.tiny), built into run.dir/base_model"
    if not os.path.exists(d):
        hint = (f"build it with python tools/build_tiny_agent.py --out {d}" if path.startswith("builtin:")
                else f"point model.path at {MODEL_HINT}; nothing is downloaded")
        raise StartupError(f"model.path: {path} does not exist: {hint}")
    if not os.path.isdir(d):
        raise StartupError(f"model.path: {path} is a file, not a directory: point it at {MODEL_HINT}")
    cfg_path = os.path.join(d, "config.json")
    try:
        with open(cfg_path) as f:
            mcfg = json.load(f)
    except FileNotFoundError:
        raise StartupError(f"model.path: {path} is not a model directory (no config.json): point it at "
                           f"{MODEL_HINT}") from None
    except (OSError, ValueError) as e:
        raise StartupError(f"model.path: {cfg_path} cannot be read as JSON ({e})") from None
    if not isinstance(mcfg, dict) or "model_type" not in mcfg:
        raise StartupError(f"model.path: {cfg_path} has no model_type: {path} is not a Hugging Face model "
                           f"directory")
    if not any(glob.glob(os.path.join(d, w)) for w in WEIGHTS):
        raise StartupError(f"model.path: {path} has a config.json but no weights (*.safetensors): copy the "
                           f"checkpoint's weight files there")
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


def check_start(cfg) -> None:
    """What every launch checks first (rank by rank; each line the same on every rank)."""
    check_run_dir(cfg.run.dir)
    check_model_dir(cfg.model.path)
    check_data_files(cfg)


def dry_run(cfg, world_size: int) -> list[str]:
    """Everything a start checks, and what it finds, without a process group, a model or a step: the report's
    lines. Raises :class:`StartupError` (one line) at the first failure."""
    p = cfg.parallel
    lines = [f"config: valid; algo={cfg.algo.name} objective={cfg.objective.name} env={cfg.env.name} "
             f"engine={cfg.engine.name}",
             f"world: {world_size} rank(s) = dp {p.dp} x tp {p.tp}"]
    check_run_dir(cfg.run.dir)
    lines.append(f"run.dir: {os.path.abspath(cfg.run.dir)} (writable)")
    lines.append(check_model_dir(cfg.model.path))
    lines += check_data_files(cfg)
    if cfg.engine.name == "vllm":
        from esopt_mp.engine.vllm import preflight

        try:
            preflight(cfg)
        except (ValueError, RuntimeError, OSError) as e:
            raise StartupError(str(e)) from None
        lines.append("engine: vllm importable, the model's architecture mapped")
    if cfg.objective.name in ("agent", "harness"):
        env = cfg.env
        if cfg.objective.name == "agent":
            try:
                env.spec.check(env.section, env, first=True)
            except Exception as e:  # noqa: BLE001 - whatever the env's check raised, in one line
                raise StartupError(f"env.name={env.name}: the start-up check failed: {type(e).__name__}: {e}") \
                    from None
            lines.append(f"env: {env.name} start-up check passed"
                         + (f" (sandbox level {env.sandbox.level})" if env.spec.runs_code else ""))
        try:
            if cfg.objective.name == "harness":
                from esopt_mp.agent.harness import harness_tasks

                train, held = harness_tasks(cfg.objective, env)
            else:
                from esopt_mp.agent.episodes import load_tasks

                train, held = load_tasks(env)
        except Exception as e:  # noqa: BLE001 - too few tasks, a bad file, a source that failed
            raise StartupError(f"env.name={env.name}: its tasks: {type(e).__name__}: {e}") from None
        lines.append(f"tasks: {len(train)} training, {len(held)} held-out")
    return lines


def check_run_to_read(run_dir: str, base: str | None = None) -> dict:
    """A finished or stopped run's directory, for a tool that reads it (replay, export): its ``config.json``."""
    if not os.path.isdir(run_dir):
        raise StartupError(f"{run_dir}: no such run directory: pass --run-dir the run.dir of a training run")
    path = os.path.join(run_dir, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise StartupError(f"{run_dir} is not a run directory (no config.json): pass --run-dir the run.dir a "
                           f"training run wrote") from None
    except (OSError, ValueError) as e:
        raise StartupError(f"{path} cannot be read ({e})") from None
    model = base or cfg.get("base_model")
    if not model or not os.path.isdir(model):
        raise StartupError(f"the run's base model {model} is gone: pass --base DIR (the model the run started "
                           f"from)")
    return cfg
