"""The files a run writes into ``run.dir``: never through a symbolic link, and append-only logs cut back to their
last complete line before a resumed run appends to them.

A link planted in ``run.dir`` (``metrics.jsonl -> ~/.bashrc``) would make the trainer write outside the run
directory. Every run file is therefore opened with ``O_NOFOLLOW`` on its last component (:func:`open_run_file`: a
link is refused, naming the file) or replaced whole (:func:`write_atomic`: a temporary created with
``O_EXCL | O_NOFOLLOW``, renamed over the name, which replaces a link rather than writing through it); the folders
a run writes into are made by :func:`run_subdir` / :func:`fresh_dir`, which refuse or remove a link.

A crash can leave an append-only file with a torn last line, or a power loss zero-filled blocks after the last
complete one. :func:`cut_torn_tail` removes that tail (the ledger's repair and :func:`repair_jsonl` for
``metrics.jsonl`` and ``trajectories.jsonl``) so that a resumed run never glues a record onto it, and
:func:`read_jsonl` skips a line that is not a record instead of failing the reader.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from esopt_mp.config import TrainConfig

log = logging.getLogger(__name__)

_MODES = {  # open() mode -> os.open flags; every one refuses a link as the last component
    "r": os.O_RDONLY, "rb": os.O_RDONLY, "r+b": os.O_RDWR,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "ab": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
}
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
RUN_NAMES = ("config.json", "history.jsonl", "metrics.jsonl", "trajectories.jsonl", "skill.jsonl", "training.png",
             ".wandb_run_id", ".mlflow_run_id", "ckpt", "contexts", "base_model", "baseline", "export", "tensorboard",
             "wandb", "mlruns")  # what a run writes at the top of run.dir


class RunFileError(RuntimeError):
    """A path in the run directory the run must not write: a symbolic link (or a link where a folder goes)."""


def _refuse_link(path: str) -> RunFileError:
    return RunFileError(f"{path} is a symbolic link: a run writes its files itself, never through a link; remove "
                        f"the link (or use a new run.dir)")


def check_no_links(run_dir: str) -> None:
    """Refuse a run directory where any name the run writes (:data:`RUN_NAMES`) is a symbolic link: checked by every
    rank at start, before any process group, so all of them stop with the same line."""
    for name in RUN_NAMES:
        no_link(os.path.join(run_dir, name))


def open_run_file(path: str, mode: str = "a", encoding: str | None = None):
    """``open(path, mode)`` for a file in the run directory, refusing (:class:`RunFileError`) a symbolic link there
    instead of writing, truncating or reading through it (``O_NOFOLLOW``), and anything but a regular file (a
    FIFO would block the run for good)."""
    try:  # non-blocking: a FIFO planted there must not hang the open
        fd = os.open(path, _MODES[mode] | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), 0o666)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):  # EMLINK: FreeBSD's O_NOFOLLOW
            raise _refuse_link(path) from None
        if e.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO nobody reads, a folder
            raise RunFileError(f"{path} is not a regular file: a run writes its files itself; remove it (or use a "
                               "new run.dir)") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RunFileError(f"{path} is not a regular file: a run writes its files itself; remove it (or use a "
                               "new run.dir)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode, encoding=None if "b" in mode else encoding or "utf-8")
    except BaseException:
        os.close(fd)
        raise


def write_atomic(path: str, data: str | bytes) -> None:
    """``path`` holds ``data`` or what it held before, never a torn file: a temporary created next to it with
    ``O_EXCL | O_NOFOLLOW`` (a planted file or link under its name is not written through), fsynced, renamed over
    ``path`` (which replaces a link there, never follows it), the rename fsynced in its folder."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.unlink(tmp)  # a leftover of a crashed writer with this pid (a link is removed, not followed)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    """Make a folder's entries (a created or renamed file) durable."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def no_link(path: str) -> str:
    """``path``, refused (:class:`RunFileError`) where it is a symbolic link: a name the run is about to create."""
    if os.path.islink(path):
        raise _refuse_link(path)
    return path


def run_subdir(path: str) -> str:
    """``path``, a folder the run writes into, made if missing; a symbolic link there is refused
    (:class:`RunFileError`), so nothing the run saves lands outside the run directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # run.dir (itself a link: the user's choice)
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    if not os.path.isdir(no_link(path)):
        raise RunFileError(f"{path} is not a directory: the run keeps a folder there; move the file away")
    return path


def remove_path(path: str) -> None:
    """Remove whatever is at ``path``: a link or file is unlinked (its target untouched), a folder removed whole."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def fresh_dir(path: str) -> str:
    """An empty folder at ``path`` made by this call (whatever was there, a planted link included, removed first):
    what a save writes into is always the run's own folder."""
    remove_path(path)
    os.mkdir(path)
    return path


def cut_torn_tail(path: str, end: int, size: int, after: str) -> None:
    """Truncate ``path`` (``size`` bytes) to its first ``end`` bytes, the complete records, and fsync: the shared
    repair of an append-only run file before it is appended to again. ``after`` says what the kept part ends
    with, for the warning."""
    if end == size:
        return
    log.warning("%s: dropping a torn tail of %d bytes after %s", path, size - end, after)
    with open_run_file(path, "r+b") as f:
        f.truncate(end)
        f.flush()
        os.fsync(f.fileno())


def _record(line: bytes) -> dict | None:
    """The JSON object a line holds, zero bytes around it ignored (a record appended after zero-filled blocks)."""
    line = line.strip(b"\0 \t\r\n")
    if not line:
        return None
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def complete_end(f, size: int, block: int = 1 << 16) -> int:
    """Byte length of the prefix of binary file ``f`` (``size`` bytes) that ends with its last complete record: a
    newline-terminated line holding a JSON object. Read backwards from the end, so a long log costs its tail."""
    want = block
    while True:
        start = max(0, size - want)
        f.seek(start)
        buf = f.read(size - start)
        stop = buf.rfind(b"\n")
        while stop >= 0:
            begin = buf.rfind(b"\n", 0, stop) + 1
            if begin == 0 and start > 0:
                break  # the line starts before what was read: read more
            if _record(buf[begin:stop]) is not None:
                return start + stop + 1
            stop = begin - 1
        if start == 0:
            return 0
        want *= 4


def repair_jsonl(path: str) -> None:
    """Cut the torn tail (a partial line, zero-filled blocks) off the JSONL run file ``path``, if it has one, so a
    resumed run appends after its last complete record; a symbolic link there is refused."""
    try:
        f = open_run_file(path, "rb")  # a link, dangling or not, is refused
    except FileNotFoundError:
        return
    with f:
        size = os.fstat(f.fileno()).st_size
        end = complete_end(f, size)
    cut_torn_tail(path, end, size, f"its last complete record (byte {end})" if end else "no complete record")


def read_jsonl(path: str) -> list[dict]:
    """The JSON-object records of the run file ``path``, one per line; a line that is not one (torn by a crash,
    zero-filled by a power loss) is skipped with a warning instead of failing the reader. A link there is refused,
    not read through (:func:`open_run_file`)."""
    out, bad = [], 0
    with open_run_file(path, "rb") as f:
        for line in f:
            rec = _record(line)
            if rec is not None:
                out.append(rec)
            elif line.strip(b"\0 \t\r\n"):
                bad += 1
    if bad:
        log.warning("%s: skipped %d line(s) that are not JSON records (torn by a crash?)", path, bad)
    return out


def write_config(cfg: "TrainConfig", rank: int, base_model: str, identity: dict) -> None:
    """``run.dir/config.json`` (rank 0): the whole config, the resolved model and the run identity (``identity``
    from :func:`esopt_mp.identity.config_identity`), from which a replay rebuilds the run and a refusal names what
    differs. Replaced whole: a crash leaves the old file or the new one, and a link there is replaced, not
    written through."""
    if rank != 0:
        return
    write_atomic(os.path.join(cfg.run.dir, "config.json"),
                 json.dumps(dict(cfg.to_dict(), base_model=base_model, config_hash=identity["hash"],
                                 identity=identity["fields"]), indent=1))


def trajectories_file(cfg: "TrainConfig", rank: int) -> str | None:
    """``run.dir/trajectories.jsonl`` when ``run.trajectories`` is on, its torn tail cut on rank 0 (the one that
    appends) before a resumed run appends to it; a symbolic link there is refused before any episode."""
    if not cfg.run.trajectories:
        return None
    path = os.path.join(cfg.run.dir, "trajectories.jsonl")
    if rank == 0:
        repair_jsonl(path)
    return path
