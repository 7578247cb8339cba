"""The paper's task data, shipped inside the package (see README.md here for origin and licence).

Config values name a file as ``data:<relative path>`` (e.g. ``env.train_path=data:sudoku/train.jsonl``)
so a profile works in any clone or installation: the prefix resolves against :func:`data_root`,
which is this folder unless the ``ESOPT_DATA`` environment variable names another root with the
same layout. Any other value is an ordinary filesystem path and is returned unchanged. The
config keeps the ``data:`` string, so the same profile hashes identically on every machine.
"""
from __future__ import annotations

import os

PREFIX = "data:"
ENV_VAR = "ESOPT_DATA"
_HERE = os.path.dirname(os.path.abspath(__file__))
# files that are regenerated rather than shipped, and the command that writes them
_BUILT = {"ahd/datasets/tsp_constructive/test": "python -m esopt_mp.data.ahd_build"}


def data_root() -> str:
    """``$ESOPT_DATA`` when set and non-empty, else the package's own data folder."""
    return os.environ.get(ENV_VAR) or _HERE


def data_path(rel: str, must_exist: bool = True) -> str:
    """Absolute path of ``rel`` (e.g. ``"sudoku/train.jsonl"``) under :func:`data_root`."""
    rel = rel.lstrip("/")
    if not rel or ".." in rel.replace("\\", "/").split("/"):
        raise ValueError(f"data path must be relative and stay inside the data root, got {rel!r}")
    path = os.path.join(data_root(), rel)
    if must_exist and not os.path.exists(path):
        hint = next((f"; produce it with `{cmd}`" for pre, cmd in _BUILT.items() if rel.startswith(pre)), "")
        where = f"${ENV_VAR}={data_root()}" if os.environ.get(ENV_VAR) else f"the package data folder {_HERE}"
        raise FileNotFoundError(f"no data file {rel!r} under {where}{hint}")
    return path


def resolve(value: str | None, must_exist: bool = True) -> str | None:
    """A config path value: ``data:rel`` -> :func:`data_path` (rel); anything else unchanged."""
    if value is None or not value.startswith(PREFIX):
        return value
    return data_path(value[len(PREFIX):], must_exist)
