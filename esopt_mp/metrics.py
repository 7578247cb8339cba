"""Rank-filtered logging and rank-0 metrics (JSONL)."""
from __future__ import annotations

import io
import json
import logging
import math
import os
import sys

from esopt_mp.runfiles import open_run_file, read_jsonl, repair_jsonl, write_atomic


def setup_logging(rank: int, level: str = "INFO") -> None:
    """INFO on rank 0, warnings and errors only on the others, each line tagged with its rank."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[%(asctime)s r{rank} %(name)s] %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(getattr(logging, level) if rank == 0 else logging.WARNING)
    # every HTTP request a harness's client makes is an INFO line of its HTTP library (httpx; httpx2 under openai 3)
    for noisy in ("transformers", "torch.distributed", "httpx", "httpx2", "httpcore", "httpcore2"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    from esopt_mp.progress import quiet_libraries

    quiet_libraries()


class MetricsWriter:
    """Rank 0: one JSON object per record in ``path``, and the same scalars to the trackers ``loggers`` names
    (``run.loggers``: tensorboard, wandb, mlflow; :mod:`esopt_mp.trackers`). A no-op on the other ranks.

    A torn tail a crash left in ``path`` is cut before the first append (a resumed run's records are never glued
    onto it); a symbolic link there is refused (:mod:`esopt_mp.runfiles`)."""

    def __init__(self, path: str, rank: int, loggers: list[str] = (), config: dict | None = None):
        self.path, self.enabled = path, rank == 0
        self.trackers = []
        if self.enabled:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            repair_jsonl(path)
            if loggers:
                from esopt_mp.trackers import build_trackers

                self.trackers = build_trackers(list(loggers), os.path.dirname(os.path.abspath(path)), config or {})

    def held_out(self, result: tuple[float, dict | None]) -> float:
        """A held-out evaluation's ``(score, detail)``: the detail (Mean@k/Pass@k, failures) written as an
        ``eval_detail`` record, the score returned (every trainer's ``evaluate``)."""
        score, detail = result
        if detail:
            self.write({"eval_detail": detail})
        return score

    def write(self, record: dict, durable: bool = False) -> None:
        """Append ``record``; ``durable``: on disk before this returns (fsync), for a record a later decision
        relies on surviving a power loss as the checkpoints after it do."""
        if not self.enabled:
            return
        with open_run_file(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if self.trackers:
            from esopt_mp.trackers import scalars

            shown = scalars(record)
            if shown is not None:
                for t in self.trackers:
                    t.log(*shown)

    def close(self) -> None:
        for t in self.trackers:
            t.close()
        self.trackers = []


def summary_screen(s: dict) -> str:
    """The end-of-run summary a person reads: before/after, time, memory, communication."""
    mem = s.get("peak_gpu_bytes", s.get("peak_rss_bytes", 0)) / 2**30
    where = "GPU peak allocated" if "peak_gpu_bytes" in s else "host peak RSS"
    name = s.get("algo", "es").upper()
    lines = [
        "=" * 60,
        f" {name} run finished: {s['steps']} steps"
        + (f" (resumed after step {s['resumed_from']})" if s.get("resumed_from") else ""),
        f" held-out score   {s['eval_before']:.4f} -> {s['eval_after']:.4f}  ({s['eval_after'] - s['eval_before']:+.4f})",
        f" wall time        {s['seconds']:.1f} s",
        f" {where:<16} {mem:.2f} GiB",
        f" {name + ' comm / step':<16} {s['comm_bytes_per_step']:.0f} bytes",
        f" local parameters {s['params_local']:,}",
        "=" * 60,
    ]
    return "\n".join(lines)


def last_per_step(records: list[dict], key: str) -> list[dict]:
    """Each ``key`` step's last record, in step order: a step played again after a resume from an older checkpoint
    (a kill between checkpoints) is drawn once, and the axis never runs back."""
    return sorted({r[key]: r for r in records if key in r}.values(), key=lambda r: r[key])


def plot_run(metrics_path: str, out_png: str, title: str = "") -> str | None:
    """Returns (training mean/max and held-out, on one step axis), sigma (the baselines: KL) and seconds per step
    from ``metrics.jsonl`` into one PNG titled ``title`` (the run and its settings), a step repeated by a resume
    drawn once. A line a crash tore is skipped (the end of a run never fails on it); the PNG replaces ``out_png``
    whole (a link there is replaced, not followed)."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure registry to import
    from matplotlib.ticker import MaxNLocator

    steps, evals = [], []
    for r in read_jsonl(metrics_path):
        if "return_mean" in r:
            steps.append(r)
        elif "eval" in r:
            evals.append(r)
    if not steps:
        return None
    steps, evals = last_per_step(steps, "step"), last_per_step(evals, "eval_step")
    fig = Figure(figsize=(13, 4.2))
    ax = fig.subplots(1, 3)
    x = [r["step"] for r in steps]
    ax[0].plot(x, [r["return_mean"] for r in steps], label="training, population mean")
    ax[0].plot(x, [r["return_max"] for r in steps], label="training, best member", alpha=0.6)
    ax[0].plot([r["eval_step"] for r in evals], [r["eval"] for r in evals], "o-", color="black",
               label="held-out (unperturbed weights)")
    ax[0].set_title("return")
    ax[0].set_ylabel("mean episode return")
    ax[0].legend(fontsize=7, loc="best", framealpha=0.85)
    third = next((k for k in ("sigma", "kl") if k in steps[0]), None)  # ES: sigma; the baselines: KL to the reference
    if third is not None:
        ax[1].plot(x, [r.get(third, math.nan) for r in steps], marker="." if len(x) < 30 else None)
        ax[1].set_title({"sigma": "noise scale sigma", "kl": "KL to the reference policy"}[third])
        ax[1].set_ylabel({"sigma": "sigma (std of the perturbation)", "kl": "KL (nats per token)"}[third])
        ax[1].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax[2].plot(x, [r["step_s"] for r in steps], label="whole step")
    ax[2].plot(x, [r["rollout_s"] for r in steps], label="rollouts")
    ax[2].set_title("time per step")
    ax[2].set_ylabel("seconds")
    ax[2].set_ylim(bottom=0)
    ax[2].legend(fontsize=8)
    for a in ax.flat:
        a.set_xlabel("step")
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.13, top=0.83 if title else 0.9, wspace=0.25)  # a fixed
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)  # layout: tight_layout's result for this grid, without measuring texts
    write_atomic(out_png, png.getvalue())
    return out_png
