"""Running a harness: the user's agent program, one run per episode, against the member's endpoint.

Two forms (``objective.callable`` or ``objective.command``), each run on its own thread, at most
``objective.concurrency`` at once, each under ``objective.timeout_s`` of wall clock (:class:`HarnessPool`). What an
episode's run ended as (:class:`Outcome`), by the failure rules of every episode (``FAILURE_KINDS``):

- a number (finite): the episode's return;
- raised, exited non-zero, printed no number on its last stdout line, or returned a non-finite number: ``model``
  (scores ``objective.failure_return``; the error is kept);
- ran past its wall clock: ``wall_clock`` (``failure_return``; every process of a command is killed by its keeper,
  a callable's thread is abandoned and its later requests meet the closed gate of the member's endpoint);
- raised :class:`esopt_mp.envs.InfraError`, exited 75 (EX_TEMPFAIL), or never called the endpoint: ``infra``
  (NaN: left out of the member's mean).

Plain Python (no torch): the config's validation imports this module.
"""
from __future__ import annotations

import dataclasses
import decimal
import importlib
import json
import math
import numbers
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

from esopt_mp.agent.harness_env import (
    ENV_NAME, OPENAI_ENV, escape, harness_env, is_launcher_var,
)
from esopt_mp.core.errors import InfraError, StartupError

EX_TEMPFAIL = 75  # a command's "the infrastructure failed, not the model" exit status
_TAIL = 600  # characters of a command's stderr kept in an error


class HarnessError(StartupError):
    """The harness cannot be run here (cannot be imported, its program is missing, it never calls the endpoint)."""


def check_harness_config(cfg, key: str = "objective") -> None:
    """The ``objective`` section of ``name=harness``: exactly one form, its syntax, the limits, the task files."""
    from esopt_mp.data import resolve
    from esopt_mp.typed import check

    check(bool(cfg.callable) != bool(cfg.command), key, "objective=harness needs exactly one of "
          f"{key}.callable=pkg.module:fn or {key}.command='program args'"
          + (", not both" if cfg.callable else ""))
    if cfg.callable:
        mod, sep, fn = cfg.callable.partition(":")
        check(bool(sep and mod and fn), f"{key}.callable", f"must be 'pkg.module:fn', got {cfg.callable!r}")
    else:
        try:
            argv = shlex.split(cfg.command)
        except ValueError as e:
            argv, why = [], f"cannot be split into arguments ({e})"
        else:
            why = "is empty"
        check(bool(argv), f"{key}.command", f"{why}: {cfg.command!r}")
    check(isinstance(cfg.concurrency, int) and cfg.concurrency >= 1, f"{key}.concurrency",
          f"must be >= 1, got {cfg.concurrency!r}")
    check(cfg.timeout_s > 0, f"{key}.timeout_s", f"must be > 0, got {cfg.timeout_s!r}")
    check(math.isfinite(cfg.failure_return), f"{key}.failure_return",
          f"must be a finite return the model can beat, got {cfg.failure_return!r}")
    check(cfg.openai_env in ("member", "user"), f"{key}.openai_env",
          f"must be 'member' (OPENAI_* name the member) or 'user' (the trainer's own OPENAI_* pass unchanged), "
          f"got {cfg.openai_env!r}")
    for name in cfg.env:
        check(isinstance(name, str) and re.fullmatch(ENV_NAME, name) is not None, f"{key}.env",
              f"lists the names of the trainer's environment variables a command gets, got {name!r}")
        check(not is_launcher_var(name), f"{key}.env", f"{name} is the launcher's rendezvous variable: a harness "
              "that read it would join the trainer's world; give the harness its own under another name")
        check(name not in OPENAI_ENV and not name.startswith("ESOPT_"), f"{key}.env",
              f"{name} names the member being served; objective.openai_env=user passes the trainer's own "
              "OPENAI_* instead")
    for k in ("tasks", "eval_tasks"):
        if getattr(cfg, k):
            try:
                path = resolve(getattr(cfg, k))
            except (FileNotFoundError, ValueError) as e:
                check(False, f"{key}.{k}", str(e))
            check(os.path.isfile(path), f"{key}.{k}", f"no such file: {path}")


def load_callable(spec: str) -> Callable:
    """``pkg.module:fn`` imported; one line naming the setting if it cannot be imported or is not callable."""
    mod, _, name = spec.partition(":")
    try:
        module = importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - whatever importing the user's module raised, said in one line
        raise HarnessError(f"objective.callable={spec}: cannot import {mod}: {type(e).__name__}: {e}") from None
    fn = module
    for part in name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise HarnessError(f"objective.callable={spec}: {mod} has no attribute {name!r}")
    if not callable(fn):
        raise HarnessError(f"objective.callable={spec}: {name} is a {type(fn).__name__}, not callable")
    return fn


def command_argv(command: str) -> list[str]:
    """The command's argv, its program found (on PATH, or an executable path); one line if it is not."""
    argv = shlex.split(command)
    prog = argv[0]
    found = shutil.which(prog)
    if found is None:
        where = "not an executable file" if os.sep in prog else "not found on PATH"
        raise HarnessError(f"objective.command={command}: program {prog!r} is {where}")
    return argv


@dataclasses.dataclass
class Outcome:
    """How one harness run ended: ``ret`` (NaN for ``infra``), ``failure`` (None or a ``FAILURE_KINDS`` kind)."""
    ret: float
    failure: str | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def ended(self) -> str:
        return "failed" if self.failure else "returned"


def failed(kind: str, error: str, failure_return: float) -> Outcome:
    """A failed run; its error on one line, escaped (it may carry the model's text: :func:`escape`)."""
    return Outcome(math.nan if kind == "infra" else failure_return, kind, escape(error))


def as_return(value, failure_return: float, what: str) -> Outcome:
    """A harness's result as the episode's return: a finite real number (a numpy or torch scalar, a Decimal or a
    Fraction too), else the model's failure."""
    if isinstance(value, str):
        text = value.strip()
        try:
            value = float(text)
        except ValueError:
            return failed("model", f"{what} {text[-200:]!r} is not a number", failure_return)
    if not isinstance(value, (bool, numbers.Real)) and callable(getattr(value, "item", None)):
        try:  # a one-element array or tensor (np.float32 is a Real already)
            value = value.item()
        except (ValueError, RuntimeError, TypeError):
            pass
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, decimal.Decimal)):
        return failed("model", f"{what} {shown} ({type(value).__name__}) is not a number", failure_return)
    try:
        ret = float(value)
    except (OverflowError, ValueError):
        ret = math.inf
    if not math.isfinite(ret):
        return failed("model", f"{what} {shown} is not a finite number", failure_return)
    return Outcome(ret)


class Slot:
    """An episode's run as its thread and the pool see it: ``on_cancel`` stops it (a command's whole tree)."""

    def __init__(self):
        self.on_cancel: Callable[[], None] | None = None
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        if self.on_cancel is not None:
            self.on_cancel()


def callable_job(fn: Callable, base_url: str, model: str, task, failure_return: float) -> Callable[[Slot], Outcome]:
    """One episode of ``fn(base_url, model, task) -> float``."""
    def job(slot: Slot) -> Outcome:
        try:
            value = fn(base_url, model, task)
        except InfraError as e:
            return failed("infra", f"InfraError: {e}", failure_return)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the harness's error: the episode's, the run goes on
            return failed("model", f"raised {type(e).__name__}: {e}", failure_return)
        return as_return(value, failure_return, "returned")
    return job


def command_job(argv: list[str], base_url: str, model: str, api_key: str, task, failure_return: float,
                passed=(), openai_env: str = "member") -> Callable[[Slot], Outcome]:
    """One episode of ``argv``: the task as JSON on stdin, its last stdout line the return.

    The command runs under :mod:`esopt_mp.agent.reaper` in a session of its own: when the command exits, every
    process it started (in its session or not) is ended, so nothing it left behind holds the episode or outlives
    the trainer. Its output is read as bytes, decoded with replacement (one invalid byte loses nothing), and of
    each stream the last ``_KEEP`` bytes are held as they are read (a flood is read, not stored).
    """
    def job(slot: Slot) -> Outcome:
        env = harness_env(base_url, model, api_key, passed, openai_env)
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", REAPER, str(os.getpid()), "--", *argv],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=env, start_new_session=True)
        except OSError as e:
            return failed("infra", f"could not start {argv[0]}: {type(e).__name__}: {e}", failure_return)
        run = _Running(proc)
        slot.on_cancel = run.stop
        if slot.cancelled:  # the wall clock passed while it started
            run.stop()
        tails = {"out": _Tail(proc.stdout), "err": _Tail(proc.stderr)}
        for t in tails.values():
            t.start()
        try:
            proc.stdin.write(json.dumps(task, default=str).encode())
            proc.stdin.close()
        except OSError:  # one that never reads its task: no error
            pass
        run.wait()
        until = time.monotonic() + 5.0  # every writer is gone: at once (else what was read so far)
        for t in tails.values():
            t.join(timeout=max(0.0, until - time.monotonic()))
        out, err = tails["out"].text(), tails["err"].text().strip()[-_TAIL:]
        tail = f"; stderr: {err}" if err else ""
        if proc.returncode == EX_TEMPFAIL:
            return failed("infra", f"exited {EX_TEMPFAIL} (EX_TEMPFAIL){tail}", failure_return)
        if proc.returncode != 0:
            how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited {proc.returncode}"
            return failed("model", f"{how}{tail}", failure_return)
        lines = [line for line in out.splitlines() if line.strip()]
        if not lines:
            return failed("model", f"printed nothing on stdout (its last line is the return){tail}", failure_return)
        return as_return(lines[-1], failure_return, "its last stdout line")
    return job


REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper.py")
_KEEP = 64 << 10  # bytes of each of a command's output streams held while it runs
_STOP_S = 15.0  # how long a stopped command's keeper has to end its tree (reaper._END_S: 10 s) before its
# process group is killed


class _Tail(threading.Thread):
    """Reads a pipe to its end as bytes, holding its last ``_KEEP`` bytes as it goes: what was read is there
    whenever the reading stops (a descendant elsewhere than Linux may hold the pipe open)."""

    def __init__(self, stream):
        super().__init__(daemon=True, name="esopt-harness-pipe")
        self.stream, self.data = stream, b""

    def run(self) -> None:
        try:
            for chunk in iter(lambda: self.stream.read1(1 << 16), b""):
                self.data = (self.data + chunk)[-_KEEP:]
        except (OSError, ValueError):  # closed under it
            pass

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


class _Running:
    """A started command under its keeper: :meth:`stop` (its wall clock) asks the keeper to end the tree, and kills
    the keeper's process group if it has not exited ``_STOP_S`` later; :meth:`wait` returns once it exited, its
    process group killed (whatever stayed in it) before it is reaped, so the group's id is never another's."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self._lock, self._reaped = proc, threading.Lock(), False

    def stop(self) -> None:
        with self._lock:
            if self._reaped:
                return
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                return
        timer = threading.Timer(_STOP_S, self._kill_group)
        timer.daemon = True
        timer.start()

    def _kill_group(self) -> None:
        with self._lock:
            if not self._reaped:
                _kill_group(self.proc)

    def wait(self) -> None:
        try:  # exited, not yet reaped: its pid (the group's id) cannot be reused before the group is killed
            os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass
        with self._lock:
            _kill_group(self.proc)
            self._reaped = True
        self.proc.wait()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the keeper's process group: the keeper itself if it has not ended its tree in time."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class HarnessPool:
    """Runs ``jobs`` on daemon threads, at most ``concurrency`` at once, each under ``timeout_s`` of wall clock.

    :meth:`start` returns at once (a supervisor thread launches and times the runs) so the caller's thread can
    serve the endpoint meanwhile; :meth:`live` (runs under way) and :meth:`done` are what that serving loop asks.
    An episode past its wall clock is ``wall_clock`` at once: its slot is cancelled (a command's processes
    killed) and its thread abandoned; whatever it returns later is dropped.
    """

    def __init__(self, jobs: list[Callable[[Slot], Outcome]], concurrency: int, timeout_s: float,
                 failure_return: float, name: str = "esopt-harness"):
        self.jobs, self.concurrency, self.timeout_s = jobs, concurrency, timeout_s
        self.failure_return, self.name = failure_return, name
        self.outcomes: list[Outcome | None] = [None] * len(jobs)
        self._cond = threading.Condition()
        self._running: dict[int, tuple[float, Slot]] = {}  # episode -> (its start, its slot)
        self._next = 0
        self._done = not jobs
        self._stopped = False

    def start(self) -> "HarnessPool":
        threading.Thread(target=self._supervise, name=f"{self.name}-pool", daemon=True).start()
        return self

    def live(self) -> int:
        """Runs under way (started, neither returned nor past their wall clock)."""
        with self._cond:
            return len(self._running)

    def done(self) -> bool:
        with self._cond:
            return self._done

    def wait(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._done, timeout)

    def cancel(self) -> None:
        """Stop every run (the caller's serving failed): each unfinished episode an ``infra`` failure."""
        with self._cond:
            self._stopped = True
            for k, (_, slot) in list(self._running.items()):
                self._finish(k, failed("infra", "stopped: serving the member failed", self.failure_return))
                slot.cancel()
            for k in range(self._next, len(self.jobs)):
                self.outcomes[k] = failed("infra", "not started: serving the member failed", self.failure_return)
            self._next = len(self.jobs)
            self._done = True
            self._cond.notify_all()

    def _supervise(self) -> None:
        with self._cond:
            while not self._stopped:
                while self._next < len(self.jobs) and len(self._running) < self.concurrency:
                    self._launch(self._next)
                    self._next += 1
                if not self._running:
                    self._done = True
                    self._cond.notify_all()
                    return
                now = time.perf_counter()
                for k, (t0, slot) in list(self._running.items()):
                    if now - t0 >= self.timeout_s:
                        self._finish(k, failed("wall_clock", f"wall clock {self.timeout_s:g} s exceeded",
                                               self.failure_return))
                        slot.cancel()
                if self._next < len(self.jobs) and len(self._running) < self.concurrency or not self._running:
                    continue
                first = min(t0 for t0, _ in self._running.values())
                self._cond.wait(max(0.0, first + self.timeout_s - time.perf_counter()))

    def _launch(self, k: int) -> None:
        slot = Slot()
        self._running[k] = (time.perf_counter(), slot)
        threading.Thread(target=self._run, args=(k, slot), name=f"{self.name}-{k}", daemon=True).start()

    def _run(self, k: int, slot: Slot) -> None:
        try:
            out = self.jobs[k](slot)
        except BaseException as e:  # noqa: BLE001 - a job's own bug: still this episode's, never the pool's
            out = failed("infra", f"the harness runner failed: {type(e).__name__}: {e}", self.failure_return)
        with self._cond:
            if k in self._running:  # not already past its wall clock
                self._finish(k, out)
            self._cond.notify_all()

    def _finish(self, k: int, out: Outcome) -> None:
        t0, _ = self._running.pop(k)
        out.seconds = time.perf_counter() - t0
        self.outcomes[k] = out
