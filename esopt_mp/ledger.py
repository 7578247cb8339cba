"""The seed ledger ``history.jsonl``: one self-validating JSON record per ES step.

A record is one line ``{...,"sha256":"<16 hex>"}\\n`` whose checksum covers the
exact bytes of the record without it (``{...}``). A record counts only when it
is complete: newline present and checksum valid. Appends are fsynced, so a
crash can only damage what follows the last valid record (a partial line, a
line that lost its newline, or zero-filled blocks); that torn tail is removed
*before* the next append, so a new record is never glued onto it. An invalid
line followed by a valid one cannot come from a crash and is an error naming
the line, never a silent truncation. Steps must run 0, 1, 2, ... without gaps.

Health, read from the same step's returns: two conditions make an ES step a no-op that nothing else reports --
every member's return is NaN (every episode errored: a broken sandbox, a missing tool), or all returns are equal
(shaped weights all zero). Either one, k steps in a row, means the run is burning compute on nothing: said loudly
(and the run stopped, if configured).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os

import numpy as np

from esopt_mp.runfiles import cut_torn_tail, fsync_dir, open_run_file

log = logging.getLogger(__name__)
LEDGER = "history.jsonl"
_SUFFIX_LEN = len(',"sha256":"') + 16 + len('"}')


class LedgerError(ValueError):
    """The ledger is corrupt in a way a crash cannot explain, or belongs to another configuration."""


def _digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()[:16]


def encode_record(entry: dict) -> bytes:
    """One ledger line: the JSON record with a checksum of its own bytes appended, newline-terminated."""
    payload = json.dumps(entry, separators=(",", ":")).encode()
    if not payload.startswith(b"{") or "sha256" in entry:
        raise ValueError("a ledger record is a JSON object without a 'sha256' key")
    return payload[:-1] + f',"sha256":"{_digest(payload)}"}}\n'.encode()


def decode_record(line: bytes) -> dict | None:
    """The record of a complete line (newline included), or None when it is torn or its checksum fails."""
    if not line.endswith(b"}\n") or len(line) < _SUFFIX_LEN + 3:
        return None
    body, suffix = line[: -_SUFFIX_LEN - 1], line[-_SUFFIX_LEN - 1 : -1]
    if not (suffix.startswith(b',"sha256":"') and suffix.endswith(b'"}')):
        return None
    if _digest(body + b"}") != suffix[11:27].decode("ascii", "replace"):
        return None
    try:
        entry = json.loads(body + b"}")
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None


def scan(data: bytes, path: str = LEDGER) -> tuple[list[dict], int]:
    """(valid records, byte length of the valid prefix) of a ledger's bytes.

    Everything after the last valid record is a torn tail; an invalid line
    before it raises :class:`LedgerError` naming the line.
    """
    entries, end, bad = [], 0, None
    pos, lineno = 0, 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        stop = len(data) if nl < 0 else nl + 1
        lineno += 1
        entry = decode_record(data[pos:stop])
        if entry is None:
            bad = bad or lineno
        elif bad is not None:
            raise LedgerError(f"{path}: line {bad} is corrupt (bad checksum or not a ledger record) but valid "
                              f"records follow it; a crash cannot cause this: restore the file or use a new run.dir")
        else:
            if entry.get("step") != len(entries):
                raise LedgerError(f"{path}: line {lineno} holds step {entry.get('step')}, expected {len(entries)} "
                                  f"(steps must be consecutive from 0)")
            entries.append(entry)
            end = stop
        pos = stop
    return entries, end


class Ledger:
    """Append-only step records of one run (written by rank 0, read by every rank)."""

    def __init__(self, run_dir: str, config_hash: str, rank: int):
        self.path = os.path.join(run_dir, LEDGER)
        self.config_hash, self.rank = config_hash, rank
        self._next: int | None = None  # step of the next append, once the tail has been checked

    def _scan(self) -> tuple[list[dict], int, int]:
        try:
            with open_run_file(self.path, "rb") as f:  # a link is refused, not read (repair truncates the file)
                data = f.read()
        except FileNotFoundError:
            return [], 0, 0
        entries, end = scan(data, self.path)
        for i, e in enumerate(entries):
            if e.get("config_hash") != self.config_hash:
                raise LedgerError(
                    f"{self.path} was written by a different configuration (line {i + 1}: hash "
                    f"{e.get('config_hash')} != {self.config_hash}); the hash covers what determines the weights "
                    f"(es.*, model and task content, env/engine training settings): use a new run.dir or the "
                    f"original config")
        return entries, end, len(data)

    def read(self) -> list[dict]:
        """Complete, checksummed entries in step order (a torn tail is ignored, not removed)."""
        return self._scan()[0]

    def repair(self) -> list[dict]:
        """:meth:`read`, then cut a torn tail off the file (rank 0) so that appends continue a clean file."""
        entries, end, size = self._scan()
        if self.rank == 0:
            cut_torn_tail(self.path, end, size, f"step {len(entries) - 1}")
            self._next = len(entries)
        return entries

    def append(self, entry: dict) -> None:
        """Write + fsync one record on rank 0, after removing any torn tail; its step must be the next one."""
        if self.rank != 0:
            return
        if self._next is None:
            self.repair()
        if entry.get("step") != self._next:
            raise LedgerError(f"{self.path}: appending step {entry.get('step')}, expected step {self._next}")
        line = encode_record(dict(entry, config_hash=self.config_hash))
        created = not os.path.exists(self.path)
        with open_run_file(self.path, "ab") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        if created:
            fsync_dir(os.path.dirname(self.path))
        self._next += 1


def updates_digest(entries: list[dict], h=None):
    """Running SHA-256 over what each step's update applied (seeds, signs, shaped weights, alpha, weight decay).

    A checkpoint records it for its step, so a checkpoint is only loaded
    against the ledger that produced it (not a sibling run's with the same
    config). Pass the returned hasher back in to extend it by later entries.
    """
    h = h or hashlib.sha256()
    for e in entries:
        h.update(json.dumps([e["seeds"], e["signs"], e["weights"], e["alpha"], e.get("weight_decay", 0.0)],
                            separators=(",", ":")).encode())
    return h


class DegenerateRunError(RuntimeError):
    """The run stopped learning for ``run.degenerate_steps`` steps and ``run.stop_on_degenerate`` is set."""


class Health:
    def __init__(self, degenerate_steps: int = 3, stop: bool = False):
        if degenerate_steps < 1:
            raise ValueError(f"run.degenerate_steps must be >= 1, got {degenerate_steps}")
        self.k, self.stop = degenerate_steps, stop
        self.streak = 0
        self.errors: list[str] = []  # member-level errors seen since the last check

    def note_error(self, msg: str) -> None:
        self.errors.append(msg)

    def check(self, step: int, returns, weights, episode_errors=()) -> str | None:
        """The reason step ``step`` learned nothing (None if it did); warns, and raises when configured."""
        r, w = np.asarray(returns, dtype=np.float64), np.asarray(weights, dtype=np.float64)
        errors = (list(self.errors) + list(episode_errors))[:3]
        self.errors = []
        finite = r[np.isfinite(r)]
        if finite.size == 0:
            reason = f"all {r.size} returns are NaN: every episode failed"
        elif np.all(w == 0):
            value = float(finite[0]) if np.all(finite == finite[0]) else math.nan
            reason = (f"all {finite.size} finite returns are equal ({value:g})" if not math.isnan(value)
                      else "all shaped weights are zero") + ": the update is a no-op"
        else:
            self.streak = 0
            return None
        if errors:
            reason += "; sample errors: " + " | ".join(errors)
        self.streak += 1
        if finite.size == 0 or self.streak >= self.k:
            log.error("!!! step %d learned nothing (%d step(s) in a row): %s", step, self.streak, reason)
        if self.stop and self.streak >= self.k:
            raise DegenerateRunError(
                f"stopping: {self.streak} consecutive steps learned nothing (run.degenerate_steps={self.k}, "
                f"run.stop_on_degenerate=true); last: {reason}"
            )
        return reason
