"""One run loop for every trainer (ES, GRPO, PPO): evaluate, steps, checkpoints, stop, summary.

A trainer brings its step, its held-out evaluation and its checkpoints (:class:`Trainer`); :func:`run` owns the
order and the cadence around them, so the trainers cannot drift apart in what a run logs, when it evaluates and
saves, how it stops on a signal and what its summary holds.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Protocol

import torch
from esopt_mp.lazy import moved_names
from esopt_mp.metrics import plot_run, summary_screen
from esopt_mp.progress import StepProgress

if TYPE_CHECKING:
    from esopt_mp.config import TrainConfig
    from esopt_mp.metrics import MetricsWriter
    from esopt_mp.parallel import CommStats, ParallelDims

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
MOVED = {"trajectories_file": "esopt_mp.runfiles", "write_config": "esopt_mp.runfiles"}  # kept one release


__getattr__ = moved_names(__name__, MOVED)


class Trainer(Protocol):
    """What :func:`run` drives. ``steps`` is the run's length; a resumed run starts at ``start_step``."""

    name: str  # "es", "grpo", "ppo": the progress bar's and the log's label
    resumes: bool  # a rerun of the same command continues a stopped run, or cannot (a ZeRO baseline)
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


class Stop:
    """A stop request (SIGUSR1 / SIGTERM by default): the run checkpoints after the current step and returns.

    ``requested`` may be set directly (a test stopping after the first step)."""

    def __init__(self, requested: bool = False):
        self.requested = requested

    def __call__(self, signum, frame) -> None:
        log.warning("signal %d: finishing the current step, then checkpoint and exit", signum)
        self.requested = True


def peak_memory() -> dict:
    """The process's peak memory: ``peak_gpu_bytes`` (allocated by torch) on CUDA, else ``peak_rss_bytes``."""
    if torch.cuda.is_available():
        return {"peak_gpu_bytes": torch.cuda.max_memory_allocated()}
    import resource

    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run(trainer: Trainer, stop: Stop | None = None) -> dict:
    """Evaluate, take steps ``start_step .. steps - 1``, evaluate, export: the summary, or ``{"stopped_at": n}``
    when a stop request (on any rank: the ranks agree at the step boundary) ended the run after ``n`` steps."""
    stop = stop if stop is not None else Stop()
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        return _run(trainer, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(trainer: Trainer, stop: Stop) -> dict:
    run_cfg, dims, metrics, steps, name = trainer.cfg.run, trainer.dims, trainer.metrics, trainer.steps, trainer.name
    t_start = time.perf_counter()
    before = trainer.evaluate()
    metrics.write({"eval_step": trainer.start_step, "eval": before})
    log.info("held-out score at step %d: %.4f", trainer.start_step, before)
    progress = StepProgress(name, trainer.start_step, steps, enabled=dims.rank == 0)
    try:
        stopped = _steps(trainer, stop, progress)
    finally:
        progress.close()
    if stopped is not None:
        return stopped
    after = trainer.evaluate()
    metrics.write({"eval_step": steps, "eval": after})
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


def _steps(trainer: Trainer, stop: Stop, progress: StepProgress) -> dict | None:
    """The steps, each logged, evaluated and checkpointed at its cadence; ``{"stopped_at": n}`` on a stop."""
    run_cfg, dims, metrics, steps = trainer.cfg.run, trainer.dims, trainer.metrics, trainer.steps
    for t in range(trainer.start_step, steps):
        rec = trainer.step(t)
        if t % run_cfg.log_every == 0 or t == steps - 1:
            metrics.write(rec)
        held_out = None
        if run_cfg.eval_every and (t + 1) % run_cfg.eval_every == 0 and t + 1 < steps:
            held_out = trainer.evaluate()
            metrics.write({"eval_step": t + 1, "eval": held_out})
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
