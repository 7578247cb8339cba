"""The train/eval split of a library's reset seeds, shared by the adapters whose task is a seed."""
from __future__ import annotations

import random


def split_seeds(split: str, n: int, seed: int) -> list[int]:
    """``n`` reset seeds of ``split``, drawn from ``seed``: even for "train", odd for "eval", so the two splits never
    share a game, whatever their draw seeds."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [2 * k + (split == "eval") for k in random.Random(seed).sample(range(2 ** 30), n)]
