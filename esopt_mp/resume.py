"""Bringing a run's weights back: a checkpoint loaded into this mesh (any saved dp x tp), then the ledger replayed.

The checkpoint format, its checks and the saves live in :mod:`esopt_mp.checkpoint`; a checkpoint only shortens the
replay of the ledger (:mod:`esopt_mp.ledger`), the run's ground truth.
"""
from __future__ import annotations

import logging

import torch

from esopt_mp.checkpoint import (CHUNKS, CheckpointError, CheckpointMismatch, CheckpointReadError, check_checkpoint,
                                 checkpoint_steps, dcp_failures, dcp_metadata, describe_failure)
from esopt_mp.dcp_boxes import JsonMetadataReader, box_state_dict, check_coverage
from esopt_mp.identity import diff_identity
from esopt_mp.ledger import LedgerError, updates_digest
from esopt_mp.parallel.collectives import failed_on, first_failure

log = logging.getLogger(__name__)
__all__ = ["agree_on_failure", "check_identity", "load_checkpoint_", "replay_", "restore_run_"]


def check_identity(man: dict, path: str, identity: dict | None) -> None:
    """Refuse a checkpoint written under another configuration, naming what differs."""
    if identity is None or "config_hash" not in man or man["config_hash"] == identity["hash"]:
        return
    what = diff_identity(man.get("identity") or {}, identity["fields"]) or "the config hash"
    raise CheckpointMismatch(f"{path} was written by another configuration ({what}); it belongs to another run: "
                             "use that run's config, or a new run.dir")


def load_checkpoint_(path: str, perturber, dims=None, identity: dict | None = None,
                     updates: str | None = None) -> None:
    """Load this rank's boxes from a checkpoint saved at any dp x tp layout (DCP reads only the chunks needed).

    ``updates``: this ledger's :func:`~esopt_mp.ledger.updates_digest` up to the
    checkpoint's step; another run's checkpoint is refused as a CheckpointError.
    Every check (manifest, identity, ledger tie, names, global shapes, coverage of each
    box by the saved chunks, SHA-256 of the files this rank reads) runs before
    any weight is written; failures raise :class:`CheckpointError` (or
    :class:`CheckpointMismatch`) and leave the weights untouched. No collective:
    each rank reads on its own.
    """
    import torch.distributed.checkpoint as dcp

    man = check_checkpoint(path)
    check_identity(man, path, identity)
    tie = man.get("updates_sha256")
    if updates and tie and tie != updates:
        raise CheckpointError(f"{path} was written by another run's ledger (its updates differ from this run's "
                              f"first {man['step']} steps)")
    check_checkpoint(path, [CHUNKS], digest=True)
    md = dcp_metadata(path)
    try:
        files = check_coverage(md, perturber.shards, path)
    except ValueError as e:  # an intact checkpoint that is not of this model/selection/mesh: refuse, do not skip
        raise CheckpointMismatch(f"{e}; move {path} aside to resume from an older checkpoint or the ledger") from None
    check_checkpoint(path, sorted(files), digest=True)
    states = perturber.state_tensors()
    try:
        with torch.no_grad():
            dcp.load(box_state_dict(perturber.shards, states), storage_reader=JsonMetadataReader(path, md),
                     no_dist=True)
    except dcp_failures() as e:  # a read error after the checks: the weights may be partly written; the
        raise CheckpointReadError(f"{path}: reading failed ({describe_failure(e)})") from None  # the caller reloads
    perturber.load_state_(states)  # in place: copies the master back to the device, drops a stale snapshot


def agree_on_failure(dims, error: Exception | None, what: str) -> None:
    """One verdict for all ranks (:func:`esopt_mp.parallel.collectives.first_failure`): if any rank's ``error`` is set,
    every rank raises the same line, at once. The lowest failing rank's error decides the line and the class (one
    of this module's, else RuntimeError). One process: ``error`` as it is."""
    if dims.world_size == 1:
        if error is not None:
            raise error
        return
    found = first_failure(dims, None if error is None else (type(error).__name__, str(error)))
    if found is None:
        return
    rank, (name, msg), n = found
    cls = {c.__name__: c for c in (CheckpointError, CheckpointReadError, CheckpointMismatch, LedgerError)}.get(
        name, RuntimeError)
    raise cls(f"{what} failed on {failed_on(rank, n)}: {msg}") from error


def replay_(perturber, entries: list[dict], exact_restore: bool | None = None) -> None:
    """Re-apply the ledger's steps as the run did, without rollouts: bit-identical to the original steps.

    Each step's update, and where restoring a member is not exact
    (``exact_restore`` False: es.restore=subtract without the fp32 master;
    None: the perturber's own mode) also every member's perturb and restore,
    in member order, as every rank of the run applied them: their rounding is
    part of the run's weights. Noise passes only.
    """
    exact = perturber.exact_restore if exact_restore is None else exact_restore
    for e in entries:
        sigma = e.get("sigma", 0.0)
        if not exact and sigma > 0.0:
            for seed, sign in zip(e["seeds"], e["signs"]):
                perturber.perturb(seed, sigma, sign)
                perturber.restore()
        if e["alpha"] > 0.0:
            perturber.update(e["seeds"], e["signs"], e["weights"], e["alpha"], e.get("weight_decay", 0.0),
                             **({"decay_to": e["decay_to"]} if "decay_to" in e else {}))  # es.decay_to=start


def restore_run_(run_dir: str, perturber, dims, entries: list[dict], use_checkpoint: bool = True,
                 identity: dict | None = None, exact_restore: bool | None = None) -> int:
    """Bring the weights to the end of ``entries``: newest loadable checkpoint (if wanted) + ledger replay.

    A checkpoint that fails its checks, or was written against another ledger
    (its ``updates_sha256`` differs from this ledger's first ``step``
    updates), is skipped for the previous one; with none left the replay
    starts from the base weights. Restoring is local to each rank (no
    collective), so ranks may even fall back differently and still agree;
    a rank that fails raises alone, and the caller makes every rank agree
    (:func:`agree_on_failure`). ``exact_restore``: see :func:`replay_`.
    Returns the step the checkpoint covered (0 without one).
    """
    done, dirty = 0, None
    for step, path in reversed(checkpoint_steps(run_dir, len(entries)) if use_checkpoint else []):
        try:
            load_checkpoint_(path, perturber, dims, identity, updates_digest(entries[:step]).hexdigest()[:16])
        except CheckpointError as e:
            log.warning("checkpoint of step %d not loaded, trying an older one: %s", step, e)
            if isinstance(e, CheckpointReadError):
                dirty = e
            continue
        done = step
        break
    if dirty is not None and done == 0:  # no checkpoint replaced what the failed read wrote: base is gone
        raise CheckpointError(f"{dirty}; no older checkpoint could replace the partly read weights: rerun")
    replay_(perturber, entries[done:], exact_restore)
    return done
