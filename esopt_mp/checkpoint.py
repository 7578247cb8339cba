"""Sharded, elastic checkpoints with torch.distributed.checkpoint (DCP); asynchronous save; exact resume.

The ledger (:mod:`esopt_mp.ledger`) is the run's ground truth: base weights +
ledger = the run's weights. Checkpoints only shorten the replay.
``ckpt/step_<N>/`` is a DCP checkpoint of the ES state (the fp32 master when
``master=fp32_host``), one global tensor per canonical name, written by the tp
ranks of dp group 0, each its own boxes (:mod:`esopt_mp.dcp_boxes`). Because
the noise is a function of (seed, canonical name, global index), a run saved
at one dp x tp continues exactly at another: DCP reads any saved chunking into
the new mesh's boxes.

Saving is asynchronous (:class:`Checkpointer`): the step's thread copies the
state to host memory and goes on; a background thread writes the files
(fsynced) and their SHA-256. The next save, the end of the run or a stop
waits for it; then rank 0 writes ``manifest.json`` (size and SHA-256 of every
file, the config hash and identity) last, fsyncs and renames
``step_<N>.tmp`` to ``step_<N>``. A checkpoint counts only with a manifest
whose files match it, so a kill at any point of a save, or a later
truncation, falls back to the previous complete checkpoint (or to base + full
replay).

Loading a checkpoint into this mesh and resuming (checkpoint + ledger replay) live in
:mod:`esopt_mp.resume`. A run directory is data: nothing read from it is unpickled. DCP's pickled
``.metadata`` is replaced by ``chunks.json`` (:func:`~esopt_mp.dcp_boxes.metadata_to_json`),
from which loads rebuild DCP's metadata; the tensors are read with torch's
weights-only loader.
"""
from __future__ import annotations

import concurrent.futures
import glob
import json
import logging
import os
import shutil
import threading
import warnings

import torch

from esopt_mp.dcp_boxes import box_state_dict, metadata_from_json, metadata_to_json
from esopt_mp.identity import file_sha256
from esopt_mp.ledger import LEDGER, Ledger, LedgerError
from esopt_mp.parallel.collectives import failed_on, first_failure
from esopt_mp.runfiles import fresh_dir, fsync_dir, open_run_file, run_subdir

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
CHUNKS = "chunks.json"  # DCP's metadata as JSON data (dcp_boxes.metadata_to_json)
DCP_METADATA = ".metadata"  # DCP's own, a pickle: removed from every checkpoint, never read
FORMAT = 3  # 1: per-tp-rank safetensors files; 2: DCP with its pickled metadata. Both are skipped, the ledger replays
# DCP warns on every single-process save/load that it assumes one process: that is the intent here (one writer)
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
__all__ = ["LEDGER", "Ledger", "LedgerError", "CheckpointError", "CheckpointMismatch", "CheckpointReadError",
           "Checkpointer", "check_checkpoint", "dcp_metadata", "save_checkpoint", "checkpoint_steps",
           "prune_checkpoints"]


class CheckpointError(ValueError):
    """A checkpoint is incomplete, corrupt, or does not cover this rank's shards."""


class CheckpointReadError(CheckpointError):
    """Reading failed after the checks passed: this rank's weights may be partly overwritten."""


class CheckpointMismatch(ValueError):
    """A complete checkpoint that cannot be this run's state (another configuration, or a layout that cannot map
    onto this mesh): never loaded, never skipped silently."""


def dcp_failures():
    """DCP reports a failed save/load as ``CheckpointException``, a BaseException: caught with the Exceptions."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def describe_failure(e: BaseException) -> str:
    """One line for an error, DCP's per-rank failures unpacked (its own str is a multi-line traceback)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, wrapped in sorted(failures.items()):
            exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            parts.append(f"DCP writer {rank}: {type(exc).__name__}: {exc}")
        return "; ".join(parts)
    return f"{type(e).__name__}: {e}"


def _ckpt_root(run_dir: str) -> str:
    return os.path.join(run_dir, "ckpt")


def _write_json(path: str, obj) -> None:
    with open_run_file(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_shards(tmp: str, shards, staged: list[torch.Tensor], group, writer: int) -> None:
    """DCP save of this rank's boxes into ``tmp`` (fsynced), writer 0 also describing it in ``chunks.json``, then a
    sidecar with its files' sizes and SHA-256.

    ``group``: the writers' gloo group (None: this rank is the only writer).
    Runs in the checkpointer's thread; ``staged`` must not change meanwhile.
    """
    import torch.distributed.checkpoint as dcp

    md = dcp.save(box_state_dict(shards, staged), storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                  process_group=group, no_dist=group is None)
    mine = sorted(os.path.basename(p) for p in glob.glob(os.path.join(tmp, f"__{writer}_*")))
    if writer == 0:  # every writer gets the global metadata back; one describes it
        _write_json(os.path.join(tmp, CHUNKS), metadata_to_json(md))
        mine.append(CHUNKS)
    _write_json(os.path.join(tmp, f"rank{writer}.sum.json"),
                {f: {"bytes": os.path.getsize(os.path.join(tmp, f)), "sha256": file_sha256(os.path.join(tmp, f))}
                 for f in mine})


def finalize(tmp: str, final: str, step: int, layout: dict, writers: int, identity: dict | None = None,
             updates: str | None = None) -> None:
    """Rank 0, after every writer finished: check the files against the chunk description, drop DCP's pickled
    metadata, manifest last, fsync, rename."""
    files = {}
    for r in range(writers):
        side = os.path.join(tmp, f"rank{r}.sum.json")
        with open(side) as f:
            files.update(json.load(f))
    if CHUNKS not in files:
        raise CheckpointError(f"{tmp}: writer 0 reported no {CHUNKS}")
    wanted = {s.relative_path for s in dcp_metadata(tmp).storage_data.values()}
    if wanted - set(files):
        raise CheckpointError(f"{tmp}: DCP metadata names files no writer reported: {sorted(wanted - set(files))}")
    man = {"format": FORMAT, "step": step, "layout": layout, "files": files}
    if identity:
        man.update(config_hash=identity["hash"], identity=identity["fields"])
    if updates:
        man["updates_sha256"] = updates  # ties the checkpoint to the ledger that produced it
    _write_json(os.path.join(tmp, MANIFEST), man)
    for r in range(writers):
        os.remove(os.path.join(tmp, f"rank{r}.sum.json"))
    if os.path.exists(os.path.join(tmp, DCP_METADATA)):
        os.remove(os.path.join(tmp, DCP_METADATA))
    fsync_dir(tmp)
    if os.path.exists(final):  # a re-save of this step: move the old one aside, drop it after the rename
        shutil.rmtree(final + ".old", ignore_errors=True)
        os.replace(final, final + ".old")
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(final))
    shutil.rmtree(final + ".old", ignore_errors=True)


def _in_background(fn, *args) -> concurrent.futures.Future:
    """``fn(*args)`` on a daemon thread: a write abandoned on an error path (:meth:`Checkpointer.close`), e.g.
    waiting inside DCP's collective for a peer that failed, never holds the process's exit."""
    future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()

    def run():
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 (DCP's CheckpointException included): reported by wait()
            future.set_exception(e)

    threading.Thread(target=run, name="esopt-ckpt", daemon=True).start()
    return future


class Checkpointer:
    """Saves of one run: stage on the caller's thread, write in the background, finalize on :meth:`wait`.

    Every rank calls :meth:`save` and :meth:`wait` at the same points (they
    hold barriers). Only dp group 0's tp ranks write. With ``async_save`` the
    host copy of the local state (one extra copy, freed when written) is what
    the step pays; the write overlaps the next steps. ``identity`` ({"hash",
    "fields"}) goes into the manifest so that a checkpoint of another
    configuration is refused by name.
    """

    def __init__(self, run_dir: str, dims, keep: int = 0, async_save: bool = True, identity: dict | None = None):
        self.run_dir, self.dims, self.keep, self.async_save, self.identity = run_dir, dims, keep, async_save, identity
        self._pending = None  # (step, tmp, final, future or None, updates)

    def save(self, step: int, perturber, updates: str | None = None) -> str:
        """Start saving the current state as step ``step`` (waits for the previous save first); returns its path.

        ``updates``: :func:`~esopt_mp.ledger.updates_digest` of the ledger's
        first ``step`` entries, recorded so resume checks the pairing.
        """
        self.wait()
        dims = self.dims
        root = _ckpt_root(self.run_dir)
        final = os.path.join(root, f"step_{step:06d}")
        tmp = final + ".tmp"
        group = dims.checkpoint_group()  # collective on first use: before any rank may skip
        if dims.rank == 0:
            run_subdir(root)  # a link planted as ckpt/ or step_N.tmp is refused or removed, never written through
            fresh_dir(tmp)
            fsync_dir(root)
        dims.comm.barrier()
        future = None
        if dims.dp_rank == 0:
            states = perturber.state_tensors()
            staged = [s.detach().to("cpu", copy=self.async_save) for s in states]  # the step may go on
            args = (tmp, perturber.shards, staged, group, dims.tp_rank)
            if self.async_save:
                future = _in_background(write_shards, *args)
            else:
                future = concurrent.futures.Future()
                try:
                    future.set_result(write_shards(*args))
                except dcp_failures() as e:  # reported in wait(), agreed on by every rank
                    future.set_exception(e)
        self._pending = (step, tmp, final, future, updates)
        return final

    def poll(self) -> str | None:
        """At a step boundary: finalize the pending save if every writer is done (one 1-byte all-reduce), so a
        checkpoint counts as soon as it is written, not one interval later. Its path, or None."""
        if self._pending is None:
            return None
        future = self._pending[3]
        if self.dims.comm.any(future is not None and not future.done()):
            return None
        return self.wait()

    def wait(self) -> str | None:
        """Finish the pending save on every rank: agree that all writers succeeded, finalize, prune. Its path."""
        if self._pending is None:
            return None
        step, tmp, final, future, updates = self._pending
        self._pending = None
        err = None
        if future is not None:
            try:
                future.result()
            except dcp_failures() as e:
                err = describe_failure(e)
                log.error("rank %d: writing the checkpoint of step %d failed: %s", self.dims.rank, step, err)
        if not self.dims.comm.any(err is not None) and self.dims.rank == 0:
            try:  # rank 0's manifest and rename can fail too (disk full): the others must hear it, not hang
                finalize(tmp, final, step, {"dp": self.dims.dp, "tp": self.dims.tp}, self.dims.tp, self.identity,
                         updates)
                prune_checkpoints(self.run_dir, self.keep, step)
            except (OSError, ValueError) as e:
                err = f"finalizing on rank 0: {type(e).__name__}: {e}"
                log.error("%s", err)
        found = first_failure(self.dims, err)  # one verdict for all ranks: the lowest failing rank's line
        if found is not None:
            if self.dims.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            rank, line, n = found
            raise CheckpointError(f"the checkpoint of step {step} was not written ({failed_on(rank, n)}: {line}); the "
                                  "ledger holds every step, a rerun resumes from an older checkpoint")
        return final

    def close(self) -> None:
        """Drop a pending save without finalizing or waiting (error paths: no collective, no join).

        A write still running, perhaps inside DCP's collective waiting for a
        peer that failed, is abandoned: its daemon thread does not hold the
        exit, and its ``step_N.tmp`` is a leftover the next save removes.
        """
        pending, self._pending = self._pending, None
        if pending is not None and pending[3] is not None and not pending[3].done():
            log.warning("rank %d: abandoning the unfinished checkpoint write of step %d (%s stays a leftover)",
                        self.dims.rank, pending[0], pending[1])


def save_checkpoint(run_dir: str, step: int, perturber, dims, keep: int = 0, identity: dict | None = None,
                    updates: str | None = None) -> str:
    """Synchronous save: every rank of dp group 0 writes its boxes; rank 0 finalizes, then keeps the newest ``keep``."""
    ck = Checkpointer(run_dir, dims, keep, async_save=False, identity=identity)
    ck.save(step, perturber, updates)
    return ck.wait()


def _dirs(run_dir: str) -> list[tuple[int, str, bool]]:
    """(step, path, is_leftover) of every checkpoint directory; ``step_N.tmp``/``.old`` are leftovers."""
    root = _ckpt_root(run_dir)
    out = []
    for d in os.listdir(root) if os.path.isdir(root) else []:
        stem, _, suffix = d.partition(".")
        if stem.startswith("step_") and stem[5:].isdigit():
            out.append((int(stem[5:]), os.path.join(root, d), bool(suffix)))
    return sorted(out)


def check_checkpoint(path: str, files: list[str] | None = None, digest: bool = False) -> dict:
    """The manifest of ``path`` after checking ``files`` (default all): present, sizes, SHA-256 if ``digest``."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            man = json.load(f)
        entries = man["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: no valid {MANIFEST} ({e}); the save did not complete") from None
    if man.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {man.get('format')} (this esopt_mp reads {FORMAT}: DCP data "
                              f"described by {CHUNKS}; a pickled {DCP_METADATA} is never read); the ledger replays "
                              "the steps instead")
    for name in entries if files is None else files:
        p, want = os.path.join(path, name), entries.get(name)
        if want is None or not os.path.isfile(p):
            raise CheckpointError(f"{path}: {name} is missing")
        if os.path.getsize(p) != want["bytes"]:
            raise CheckpointError(f"{path}: {name} has {os.path.getsize(p)} bytes, the manifest says {want['bytes']}")
        if digest and file_sha256(p) != want["sha256"]:
            raise CheckpointError(f"{path}: {name} does not match its SHA-256 in the manifest")
    return man


def dcp_metadata(path: str):
    """DCP's metadata of a checkpoint, rebuilt from its ``chunks.json`` (unreadable or malformed: CheckpointError)."""
    try:
        with open(os.path.join(path, CHUNKS)) as f:
            return metadata_from_json(json.load(f), os.path.join(path, CHUNKS))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable {CHUNKS} ({e})") from None


def checkpoint_steps(run_dir: str, max_step: int | None = None) -> list[tuple[int, str]]:
    """Complete checkpoints (manifest present, sizes and headers check out), oldest first."""
    out = []
    for step, path, is_tmp in _dirs(run_dir):
        if is_tmp or (max_step is not None and step > max_step):
            continue
        try:
            check_checkpoint(path)
        except CheckpointError as e:
            log.warning("skipping checkpoint: %s", e)
            continue
        out.append((step, path))
    return out


def prune_checkpoints(run_dir: str, keep: int, newest: int) -> list[str]:
    """Rank 0 after saving step ``newest``: delete all but the newest ``keep`` complete checkpoints (0: keep all).

    Also removes leftovers: ``.tmp`` directories of interrupted saves and
    checkpoints past ``newest`` (from steps the ledger no longer holds). The
    checkpoint just saved is always kept.
    """
    removed = []
    complete = {s for s, _ in checkpoint_steps(run_dir, newest)}
    kept = set(sorted(complete)[-keep:]) if keep > 0 else complete
    kept.add(newest)
    for step, path, is_tmp in _dirs(run_dir):
        stale = is_tmp or step > newest
        if stale or (keep > 0 and step not in kept):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        fsync_dir(_ckpt_root(run_dir))
        log.info("pruned %d checkpoint director%s", len(removed), "y" if len(removed) == 1 else "ies")
    return removed
