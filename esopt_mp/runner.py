"""One run loop for every trainer (ES, GRPO, PPO): evaluate, steps, checkpoints, stop, summary.

A trainer brings its step, its held-out evaluation and its checkpoints (:class:`Trainer`); :func:`run` owns the
order and the cadence around them, so the trainers cannot drift apart in what a run logs, when it evaluates and
saves, how it stops on a signal and what its summary holds.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import TYPE_CHECKING, Protocol

import torch
from esopt_mp.identity import held_out_key
from esopt_mp.lazy import moved_names
from esopt_mp.metrics import plot_run, summary_screen
from esopt_mp.progress import StepProgress
from esopt_mp.runfiles import read_jsonl
from esopt_mp.stop import Stop, stop_on_signals

if TYPE_CHECKING:
    from esopt_mp.config import TrainConfig
    from esopt_mp.metrics import MetricsWriter
    from esopt_mp.parallel import CommStats, ParallelDims

log = logging.getLogger(__name__)
MOVED = {"trajectories_file": "esopt_mp.runfiles", "write_config": "esopt_mp.runfiles"}  # kept one release


__getattr__ = moved_names(__name__, MOVED)


class Trainer(Protocol):
    """What :func:`run` drives. ``steps`` is the run's length; a resumed run starts at ``start_step``."""

    name: str  # "es", "grpo", "ppo": the progress bar's and the log's label
    resumes: bool  # a rerun of the same command continues a stopped run, or cannot (a ZeRO baseline)
    reuses_held_out: bool  # a resumed run may take its first held-out score from its run.dir (see _first_held_out)
    cfg: TrainConfig
    dims: ParallelDims
    metrics: MetricsWriter
    start_step: int
    steps: int

    @property
    def comm_stats(self) -> CommStats:
        """Bytes this trainer's collectives moved since it was built."""

    def step(self, t: int) -> dict:
        """Step ``t``; its metrics record."""

    def evaluate(self) -> float:
        """Held-out score of the current weights (details, if any, to the trainer's metrics)."""

    def save(self, step: int) -> None:
        """Start a checkpoint of the weights after ``step`` steps (finished by :meth:`poll` or :meth:`wait`)."""

    def poll(self) -> None:
        """Complete a checkpoint whose background write finished."""

    def wait(self) -> None:
        """Finish the pending checkpoint."""

    def finish(self) -> dict:
        """After the final evaluation: exports; the trainer's own summary fields (``params_local``, ...)."""

    def close(self) -> None: ...


# algo.name -> its trainer ("module:Class", imported when asked for)
TRAINERS = {"es": "esopt_mp.trainer:ESTrainer", "grpo": "esopt_mp.baseline_trainer:BaselineTrainer",
            "ppo": "esopt_mp.baseline_trainer:BaselineTrainer"}


def build_trainer(cfg: TrainConfig, dims: ParallelDims) -> Trainer:
    """The trainer of ``cfg.algo.name``: ES, or the GRPO/PPO baseline trainer (both build their parts with
    :mod:`esopt_mp.build`)."""
    import importlib

    module, _, cls = TRAINERS[cfg.algo.name].partition(":")
    return getattr(importlib.import_module(module), cls)(cfg, dims)


def peak_memory() -> dict:
    """The process's peak memory: ``peak_gpu_bytes`` (allocated by torch) on CUDA, else ``peak_rss_bytes``."""
    if torch.cuda.is_available():
        return {"peak_gpu_bytes": torch.cuda.max_memory_allocated()}
    import resource

    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run(trainer: Trainer, stop: Stop | None = None) -> dict:
    """Evaluate, take steps ``start_step .. steps - 1``, evaluate, export: the summary, or ``{"stopped_at": n}``
    when a stop request (on any rank: the ranks agree at the step boundary) ended the run after ``n`` steps; a
    request made before the first step (as the model loaded, or during the first evaluation) ends it before it."""
    with stop_on_signals(stop if stop is not None else Stop()) as stop:
        return _run(trainer, stop)


def _run(trainer: Trainer, stop: Stop) -> dict:
    run_cfg, dims, metrics, steps, name = trainer.cfg.run, trainer.dims, trainer.metrics, trainer.steps, trainer.name
    t_start = time.perf_counter()
    if dims.comm.any(stop.requested):  # a signal while the model loaded: nothing to save, the rerun starts here
        return _stopped_before(trainer)
    key = held_out_key(trainer.cfg)
    before = _first_held_out(trainer, key)
    # from here the scores of later steps are this run's again; on disk before any later checkpoint is (a lost
    # record would let a rerun after a power loss reuse a score of weights this run replaced)
    metrics.write({"run_start": trainer.start_step}, durable=True)
    if dims.comm.any(stop.requested):  # during that evaluation (a resumed run's rerun reuses its score)
        return _stopped_before(trainer)
    progress = StepProgress(name, trainer.start_step, steps, enabled=dims.rank == 0)
    try:
        stopped = _steps(trainer, stop, progress, key)
    finally:
        progress.close()
    if stopped is not None:
        return stopped
    after = trainer.evaluate()
    _write_score(metrics, steps, after, key)
    summary = {"eval_before": before, "eval_after": after, "steps": steps, "resumed_from": trainer.start_step,
               "seconds": time.perf_counter() - t_start,
               "comm_bytes_per_step": trainer.comm_stats.total / max(1, steps - trainer.start_step)}
    memory = peak_memory()  # of the training, before an export's copies
    summary = {**summary, **trainer.finish(), **memory}
    metrics.write({"summary": summary})
    if dims.rank == 0:
        plot_run(metrics.path, os.path.join(run_cfg.dir, "training.png"), title=run_title(trainer.cfg))
        print(summary_screen(summary), file=sys.stderr)
    log.info("%s held-out score: %.4f -> %.4f over %d steps", name.upper(), before, after, steps)
    return summary


def _first_held_out(trainer: Trainer, key: str) -> float:
    """The held-out score at ``start_step``. A resumed run reuses a score its run.dir recorded at that step
    (:func:`_recorded_held_out`): the weights a resume restores are those that were evaluated, bit for bit, and a
    requeue would otherwise pay a whole evaluation for a number it has."""
    t, recorded = trainer.start_step, None
    if t > 0 and trainer.reuses_held_out:
        if trainer.dims.rank == 0:  # the one that writes metrics.jsonl
            recorded = _recorded_held_out(trainer.metrics.path, t, key)
        recorded = trainer.dims.comm.broadcast_object(recorded, src=0, dim="world")
    if recorded is not None:
        log.info("held-out score at step %d: %.4f (recorded before the stop, not evaluated again)", t, recorded)
        return recorded
    score = trainer.evaluate()
    _write_score(trainer.metrics, t, score, key)
    log.info("held-out score at step %d: %.4f", t, score)
    return score


def _write_score(metrics: MetricsWriter, step: int, score: float, key: str) -> None:
    """A held-out score's record, under the key :func:`_recorded_held_out` matches a resume's settings against."""
    metrics.write({"eval_step": step, "eval": score, "eval_key": key})


def _recorded_held_out(path: str, step: int, key: str) -> float | None:
    """The newest score ``path`` holds at ``step`` under ``key``, unless a run started before ``step`` after it
    (``run_start`` records): that run took the steps up to ``step`` again, and a requeue on a GPU, or after a
    crash rolled it back to an older checkpoint, may have reached other weights there without scoring them (another
    ``run.eval_every``). None, and the run evaluates, when there is none, when an infrastructure fault cost that
    evaluation episodes (a stop signal reaching a browser or a sandbox as well), or when the file cannot be read."""
    if not os.path.lexists(path):
        return None
    try:
        records = read_jsonl(path)
        for i in range(len(records) - 1, -1, -1):
            r = records[i]
            if isinstance(r.get("run_start"), int) and r["run_start"] < step:
                return None
            if r.get("eval_step") == step and r.get("eval_key") == key:
                detail = records[i - 1].get("eval_detail") if i else None  # written just before its score
                if isinstance(detail, dict) and (detail.get("failures") or {}).get("infra"):
                    return None
                score = r.get("eval")
                ok = isinstance(score, (int, float)) and not isinstance(score, bool) and math.isfinite(score)
                return float(score) if ok else None
    except Exception as e:  # noqa: BLE001 - a shortcut only: never a reason to stop the run, nor one rank of it
        log.warning("%s: not read (%s); evaluating instead of reusing a recorded score", path, e)
    return None


def _stopped_before(trainer: Trainer) -> dict:
    """A stop before the first step: nothing new to save (the run.dir holds what the run started from), so even a
    run that cannot resume (a ZeRO baseline, always at step 0 here) is requeued (``launch/train.py``)."""
    log.warning("stopped before step %d/%d on request; nothing new to save; rerun the same command to %s",
                trainer.start_step + 1, trainer.steps, "go on" if trainer.start_step else "start it")
    return {"stopped_at": trainer.start_step}


def _steps(trainer: Trainer, stop: Stop, progress: StepProgress, key: str) -> dict | None:
    """The steps, each logged, evaluated (scores under ``key``) and checkpointed at its cadence; ``{"stopped_at": n}``
    on a stop."""
    run_cfg, dims, metrics, steps = trainer.cfg.run, trainer.dims, trainer.metrics, trainer.steps
    for t in range(trainer.start_step, steps):
        rec = trainer.step(t)
        if t % run_cfg.log_every == 0 or t == steps - 1:
            metrics.write(rec)
        held_out = None
        if run_cfg.eval_every and (t + 1) % run_cfg.eval_every == 0 and t + 1 < steps:
            held_out = trainer.evaluate()
            _write_score(metrics, t + 1, held_out, key)
        progress.step(t, rec, held_out)
        last = t + 1 == steps
        stopping = dims.comm.any(stop.requested)  # one verdict for all ranks, at the step boundary
        if stopping or last or (run_cfg.checkpoint_every and (t + 1) % run_cfg.checkpoint_every == 0):
            trainer.save(t + 1)  # written in the background while the next steps run (where the trainer can)
        if stopping or last:
            trainer.wait()
        else:
            trainer.poll()  # a finished background write becomes a complete checkpoint now
        if stopping and not last:
            log.warning("stopped after step %d/%d on request; the checkpoint after it is saved; %s", t + 1, steps,
                        "rerun the same command to resume" if trainer.resumes else
                        f"this {trainer.name.upper()} run cannot resume: a rerun starts in a new run.dir")
            return {"stopped_at": t + 1}
    return None


def run_title(cfg: TrainConfig) -> str:
    """The plot's title: the run's name and the settings that tell runs apart."""
    model = cfg.model.path or f"tiny {cfg.model.tiny.arch}"
    model = os.path.basename(model.rstrip("/")) if "/" in model else model.replace("builtin:", "")
    algo = cfg.algo.name.upper()
    if cfg.algo.name == "es":
        pop = f"G={cfg.es.population}, sigma {cfg.es.sigma.start:.1e}->{cfg.es.sigma.end:.1e} ({cfg.es.sigma.kind})"
    else:
        pop = f"lr {cfg.algo.lr:.1e}"
    what = cfg.env.name if cfg.objective.episodic else cfg.objective.name
    return (f"{os.path.basename(os.path.abspath(cfg.run.dir))}: {algo} on {what}, {model}, {pop}, "
            f"dp={cfg.parallel.dp} tp={cfg.parallel.tp}")
