"""Symbolic answer checking (math-verify) with a bounded time on any thread.

math-verify bounds its own ``parse``/``verify`` with ``signal.alarm``, which only works on the main thread, and a
check that runs long inside one C call (a huge power) is not interrupted by a signal at all. So checks run in a few
persistent worker processes, each a plain loop on its own main thread with math-verify's alarms off; the caller
waits at most ``timeout_s`` of wall clock for the verdict and kills a worker that overruns (a fresh one starts on
the next check). The verdict is the same whichever thread asks and whatever the sandbox level; an answer that cannot
be checked in time, or that makes the checker fail, is not correct.
"""
from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import threading
import time

from esopt_mp.envs.base import InfraError

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0  # wall clock of one check (math-verify's own default bounds parse and verify at 5 s each)
START_TIMEOUT_S = 120.0  # a worker's start-up (Python + sympy imports), on a busy machine
MEMORY_MB = 2048  # a worker's address space: an answer expanding without end fails there, not in the trainer
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the folder holding esopt_mp
_BOOT = "import sys; sys.path.insert(0, {root!r}); from esopt_mp.envs.answers import serve; serve({cpu_s!r})"


def _wrap(s: str) -> str:
    return s if "$" in s or "\\boxed" in s else f"${s}$"


def serve(cpu_s: float) -> None:
    """The worker: one JSON request ``[given, reference]`` a line on stdin, ``true``/``false`` a line back.

    Each check may use ``cpu_s`` more CPU seconds (SIGXCPU ends a worker whose caller is gone mid-check)."""
    import resource

    def lower(kind, soft):  # never above a hard limit the trainer already has
        hard = resource.getrlimit(kind)[1]
        resource.setrlimit(kind, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))

    lower(resource.RLIMIT_AS, MEMORY_MB << 20)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the libraries print goes to stderr, not into the replies
    logging.disable(logging.WARNING)  # math-verify warns that its timeouts are off: this loop is bounded from outside
    from math_verify import parse, verify

    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        given, reference = json.loads(line)
        use = resource.getrusage(resource.RUSAGE_SELF)
        lower(resource.RLIMIT_CPU, int(use.ru_utime + use.ru_stime + cpu_s) + 1)
        try:
            ok = bool(verify(parse(_wrap(reference), parsing_timeout=None),
                             parse(_wrap(given), parsing_timeout=None), timeout_seconds=None))
        except BaseException:  # noqa: BLE001 - MemoryError, RecursionError, anything: not shown correct
            ok = False
        out.write("true\n" if ok else "false\n")
        out.flush()


class _Worker:
    def __init__(self, start_timeout_s: float, cpu_s: float):
        boot = _BOOT.format(root=_ROOT, cpu_s=cpu_s)
        with tempfile.TemporaryFile() as err:  # what a worker that does not start says, for the error line
            self.proc = subprocess.Popen([sys.executable, "-c", boot], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, close_fds=True, start_new_session=True)
            self.buf = b""
            if self.read_line(start_timeout_s) != "ready":
                code = self.kill()
                err.seek(0)
                tail = err.read()[-2000:].decode(errors="replace").strip().splitlines()[-1:]
                raise InfraError(f"the answer checker ({sys.executable}, math-verify) did not start (given "
                                 f"{start_timeout_s:g} s; exit code {code})" + (f": {tail[0]}" if tail else ""))

    def read_line(self, timeout_s: float) -> str | None:
        """The next line, or None when ``timeout_s`` passes or the worker's stdout closes first."""
        deadline, fd = time.monotonic() + timeout_s, self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def ask(self, given: str, reference: str, timeout_s: float) -> bool | str:
        """The verdict, else "overran" (no verdict within ``timeout_s``) or "died" (the worker is unusable then)."""
        t = time.monotonic()
        try:
            self.proc.stdin.write((json.dumps([given, reference]) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            return "died"
        line = self.read_line(timeout_s)
        if line is None:
            return "overran" if time.monotonic() - t >= timeout_s else "died"
        return line == "true"

    def kill(self) -> int | None:
        self.proc.kill()
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a kill not reaped in 10 s
            return None
        finally:
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass


class AnswerChecker:
    """At most ``workers`` checks at once, each in a worker process, each answered within ``timeout_s``."""

    def __init__(self, workers: int = 0, timeout_s: float = TIMEOUT_S, start_timeout_s: float = START_TIMEOUT_S):
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        self._slots = threading.BoundedSemaphore(self.workers)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self.unchecked = 0  # checks that got no verdict (overran timeout_s, or the checker died twice)
        self._started = False  # a worker has started once (:meth:`ready`)

    def check(self, given: str, reference: str) -> bool:
        with self._slots:
            for attempt in range(2):  # a worker that died (killed from outside?) gets one fresh try
                with self._lock:
                    worker = self._idle.pop() if self._idle else None
                if worker is None:
                    worker = _Worker(self.start_timeout_s, 2 * self.timeout_s)
                ok = worker.ask(given, reference, self.timeout_s)
                if not isinstance(ok, str):
                    with self._lock:
                        self._idle.append(worker)
                    return ok
                code = worker.kill()
                if ok == "overran" or attempt:
                    with self._lock:
                        self.unchecked += 1
                    log.warning("answer check of %r against %r: the checker %s (exit code %s): not correct",
                                given[:80], reference[:80],
                                f"gave no verdict within {self.timeout_s:g} s" if ok == "overran" else "died twice",
                                code)
                    return False
        return False  # pragma: no cover - the loop returns

    def ready(self) -> None:
        """Start a worker if none has started yet (:class:`InfraError` if it cannot): a checker that cannot run
        must fail every answer alike, not only those that differ from the reference as text."""
        with self._lock:
            if self._started:
                return
        worker = _Worker(self.start_timeout_s, 2 * self.timeout_s)
        with self._lock:
            self._started = True
            self._idle.append(worker)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


_checker: tuple[int, AnswerChecker] | None = None  # (the process that owns it, the checker)
_checker_lock = threading.Lock()


def checker() -> AnswerChecker:
    """This process's checker, started at its first use and closed at exit (a forked child starts its own)."""
    global _checker
    with _checker_lock:
        if _checker is None or _checker[0] != os.getpid():
            _checker = (os.getpid(), AnswerChecker())
            atexit.register(_checker[1].close)
        return _checker[1]


def answers_match(given: str, reference: str) -> bool:
    """Symbolic equivalence via math-verify (LaTeX and plain expressions); the same strings match at once, once
    the checker has shown it runs (a broken checker fails every answer, so no answer is favoured)."""
    if importlib.util.find_spec("math_verify") is None:  # pragma: no cover - dependency of the [math] extra
        raise ImportError("math_react needs math-verify: pip install 'esopt_mp[math]'")
    c = checker()
    c.ready()
    if given.strip() == reference.strip():
        return True
    return c.check(given, reference)
