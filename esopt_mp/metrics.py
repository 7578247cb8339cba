"""Rank-filtered logging and rank-0 metrics (JSONL)."""
from __future__ import annotations

import json
import logging
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
    for noisy in ("transformers", "torch.distributed", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


class MetricsWriter:
    """Appends one JSON object per record to ``path``; a no-op on ranks other than 0."""

    def __init__(self, path: str, rank: int):
        self.path, self.enabled = path, rank == 0
        if self.enabled:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def plot_run(metrics_path: str, out_png: str) -> str | None:
    """Train return, held-out score, sigma and time per step from ``metrics.jsonl`` into one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig, ax = plt.subplots(2, 2, figsize=(10, 6.5))
    x = [r["step"] for r in steps]
    ax[0, 0].plot(x, [r["return_mean"] for r in steps], label="mean")
    ax[0, 0].plot(x, [r["return_max"] for r in steps], label="max", alpha=0.6)
    ax[0, 0].set_title("train return over the population")
    ax[0, 0].legend()
    ax[0, 1].plot([r["eval_step"] for r in evals], [r["eval"] for r in evals], "o-")
    ax[0, 1].set_title("held-out score (sigma = 0)")
    ax[1, 0].plot(x, [r["sigma"] for r in steps])
    ax[1, 0].set_title("sigma")
    ax[1, 1].plot(x, [r["step_s"] for r in steps], label="step")
    ax[1, 1].plot(x, [r["rollout_s"] for r in steps], label="rollouts")
    ax[1, 1].set_title("seconds per step")
    ax[1, 1].legend()
    for a in ax.flat:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png
