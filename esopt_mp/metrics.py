"""Rank-filtered logging and rank-0 metrics (JSONL)."""
from __future__ import annotations

import json
import logging
import math
import os
import sys


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


class MetricsWriter:
    """Rank 0: one JSON object per record in ``path`` and, when tensorboard is installed, its
    scalars under ``<dir>/tensorboard``. A no-op on the other ranks."""

    SCALARS = ("return_mean", "return_max", "failed", "sigma", "alpha", "rollout_s", "step_s", "comm_bytes_total")

    def __init__(self, path: str, rank: int, tensorboard: bool = True):
        self.path, self.enabled = path, rank == 0
        self.tb = None
        if self.enabled:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self.tb = SummaryWriter(os.path.join(os.path.dirname(os.path.abspath(path)), "tensorboard"))
                except ImportError:
                    logging.getLogger(__name__).info("tensorboard not installed: metrics go to %s only", path)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            if "step" in record:
                for k in self.SCALARS:
                    if isinstance(record.get(k), (int, float)):
                        self.tb.add_scalar(f"train/{k}", record[k], record["step"])
            if "eval" in record:
                self.tb.add_scalar("eval/score", record["eval"], record["eval_step"])
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def summary_screen(s: dict) -> str:
    """The end-of-run summary a person reads: before/after, time, memory, communication."""
    mem = s.get("peak_gpu_bytes", s.get("peak_rss_bytes", 0)) / 2**30
    where = "GPU peak allocated" if "peak_gpu_bytes" in s else "host peak RSS"
    name = s.get("algo", "es").upper()
    lines = [
        "=" * 60,
        f" {name} run finished: {s['steps']} steps (resumed from {s['resumed_from']})",
        f" held-out score   {s['eval_before']:.4f} -> {s['eval_after']:.4f}  ({s['eval_after'] - s['eval_before']:+.4f})",
        f" wall time        {s['seconds']:.1f} s",
        f" {where:<16} {mem:.2f} GiB",
        f" {name + ' comm / step':<16} {s['comm_bytes_per_step']:.0f} bytes",
        f" local parameters {s['params_local']:,}",
        "=" * 60,
    ]
    return "\n".join(lines)


def plot_run(metrics_path: str, out_png: str) -> str | None:
    """Train return, held-out score, sigma (the baselines: KL) and time per step from ``metrics.jsonl`` into one
    PNG."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure registry to import

    steps, evals = [], []
    with open(metrics_path) as f:
        for line in f:
            r = json.loads(line)
            if "return_mean" in r:
                steps.append(r)
            elif "eval" in r:
                evals.append(r)
    if not steps:
        return None
    fig = Figure(figsize=(10, 6.5))
    ax = fig.subplots(2, 2)
    x = [r["step"] for r in steps]
    ax[0, 0].plot(x, [r["return_mean"] for r in steps], label="mean")
    ax[0, 0].plot(x, [r["return_max"] for r in steps], label="max", alpha=0.6)
    ax[0, 0].set_title("train return over the population")
    ax[0, 0].legend()
    ax[0, 1].plot([r["eval_step"] for r in evals], [r["eval"] for r in evals], "o-")
    ax[0, 1].set_title("held-out score (sigma = 0)")
    third = next((k for k in ("sigma", "kl") if k in steps[0]), None)  # ES: sigma; the baselines: KL to the reference
    if third is not None:
        ax[1, 0].plot(x, [r.get(third, math.nan) for r in steps])
        ax[1, 0].set_title({"sigma": "sigma", "kl": "KL to the reference policy"}[third])
    ax[1, 1].plot(x, [r["step_s"] for r in steps], label="step")
    ax[1, 1].plot(x, [r["rollout_s"] for r in steps], label="rollouts")
    ax[1, 1].set_title("seconds per step")
    ax[1, 1].legend()
    for a in ax.flat:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.08, top=0.95, hspace=0.4, wspace=0.2)  # tight_layout's
    fig.savefig(out_png, dpi=90)  # result for this fixed grid, without measuring every text
    return out_png
