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
