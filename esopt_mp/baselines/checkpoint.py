"""A GRPO / PPO run's checkpoint: each rank's ``torch.save`` in ``run.dir/baseline``, the newest two kept.

A save writes ``rank<r>.pt.tmp``, fsyncs it, moves the current ``rank<r>.pt`` to ``rank<r>.prev.pt`` and the new
file into its place, so a kill at any moment leaves each rank at least one whole file. The ranks' renames are not
one transaction: a kill during a save can leave one rank a step ahead of another, so a resume loads the newest step
that every rank still holds (:func:`common_step`).
"""
from __future__ import annotations

import logging
import os

import torch

from esopt_mp.runfiles import fsync_dir, open_run_file, run_subdir

log = logging.getLogger(__name__)
REQUIRED = ("step", "config_hash", "layout", "updates")  # and the optimizer's own state (its state_dict's keys)
# a file also records its rank ("rank"), checked where present


def paths(run_dir: str, rank: int) -> tuple[str, str]:
    """(the newest checkpoint of ``rank``, the one before it)."""
    root = os.path.join(run_dir, "baseline")
    return os.path.join(root, f"rank{rank}.pt"), os.path.join(root, f"rank{rank}.prev.pt")


def save(run_dir: str, rank: int, state: dict) -> str:
    """Write ``state`` as this rank's newest checkpoint, keeping the one it replaces; its path."""
    out = run_subdir(os.path.join(run_dir, "baseline"))
    path, prev = (os.path.join(out, os.path.basename(p)) for p in paths(run_dir, rank))
    with open_run_file(path + ".tmp", "wb") as f:  # a link is refused; the renames replace one
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(path):
        os.replace(path, prev)
    os.replace(path + ".tmp", path)
    fsync_dir(out)
    return path


def held(run_dir: str, rank: int) -> tuple[dict[int, str], list[str]]:
    """({step: path} of this rank's checkpoints that can be read, why each other one cannot): an unreadable file
    (one cut short by a crash) is skipped with a warning, so the one before it serves."""
    found, unreadable = {}, []
    for path in paths(run_dir, rank):
        if not os.path.isfile(path):
            continue
        try:
            found.setdefault(int(read(path)["step"]), path)
        except Exception as e:  # noqa: BLE001 - whatever a torn or foreign file raises, the other one may serve
            unreadable.append(f"{path}: {type(e).__name__}: {e}")
            log.warning("%s cannot be read (%s: %s); it is skipped", path, type(e).__name__, e)
    return found, unreadable


def stray(run_dir: str, rank: int) -> list[str]:
    """This rank's checkpoint paths that hold something a save could not replace (a folder, a link)."""
    return [p for p in paths(run_dir, rank) if os.path.lexists(p) and (os.path.islink(p) or not os.path.isfile(p))]


def set_aside_after(run_dir: str, rank: int, loaded: str, step: int) -> None:
    """After resuming at ``step`` from ``loaded``: move this rank's other file aside (``<name>.set-aside``) when it is
    of a later step (an abandoned attempt's, which the next save would otherwise keep as the one before it) or cannot
    be read (a torn file). Moved, not deleted: a read that failed for a passing reason loses nothing."""
    for path in paths(run_dir, rank):
        if path == loaded or not os.path.isfile(path):
            continue
        try:
            later = int(read(path)["step"]) > step
        except Exception:  # noqa: BLE001 - unreadable: not a file the next save may keep
            later = True
        if later:
            os.replace(path, path + ".set-aside")
            log.info("moved %s aside: not of a step up to the resumed one (%d)", path, step)


def read(path: str) -> dict:
    """A checkpoint, its tensors memory-mapped (read from disk as they are copied into the model)."""
    sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    missing = [k for k in REQUIRED if k not in sd]
    if missing:
        raise ValueError(f"not a baseline checkpoint this version writes (it has no {', '.join(missing)})")
    return sd


def common_step(dims, mine: dict[int, str]) -> tuple[str | None, str | None]:
    """(this rank's file of the newest step every rank holds, why there is none): ``(None, None)`` when no rank
    holds a checkpoint, ``(None, why)`` when no step is held by all of them."""
    everyone = dims.comm.all_gather_object(sorted(mine), "world") if dims.world_size > 1 else [sorted(mine)]
    if not any(everyone):
        return None, None
    common = set(everyone[0]).intersection(*everyone[1:])
    if not common:
        held_by = "; ".join(f"rank {r}: {', '.join(map(str, s)) or 'none'}" for r, s in enumerate(everyone))
        return None, (f"no step is held by every rank's checkpoint (steps saved after: {held_by}; a save cut "
                         "short, files removed, or another layout's run): the run cannot resume from them")
    return mine[max(common)], None
