"""One thread per browser, each with its own playwright, so that the episodes of a batch step at the same time.

Playwright's sync API is bound to the thread that started it, and BrowserGym starts one playwright per process
(``browsergym.core._get_global_playwright``) that every one of its envs then uses: browsers could only be driven
one after another from one thread. Here every call into one episode's BrowserGym env (make, reset, step, close)
runs on the :class:`Worker` thread that episode leased, and BrowserGym's lookup returns the calling thread's
own playwright (started there on first use, stopped when the worker stops). Idle workers wait for the next
episode (starting a playwright driver costs a fraction of a second) until :func:`stop_idle` (exit, SIGTERM).
A call that does not return in time (a page whose JavaScript never yields blocks playwright's calls without
their own timeout) is ended by :meth:`Worker.kill`: the worker's playwright driver and the browsers it launched
are killed, which makes the stuck call raise; the worker is not reused.
"""
from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import psutil

log = logging.getLogger(__name__)
_LOCAL = threading.local()
_IDLE: list["Worker"] = []
_LOCK = threading.RLock()  # re-entered by a SIGTERM handler (close_all) on the main thread
_PATCHED: dict = {}


def _thread_playwright():
    """This thread's playwright (BrowserGym's ``_get_global_playwright``, made per thread)."""
    pw = getattr(_LOCAL, "pw", None)
    if pw is None:
        import playwright.sync_api

        pw = _LOCAL.pw = playwright.sync_api.sync_playwright().start()
        owner = getattr(_LOCAL, "worker", None)
        if owner is not None:  # the driver process (playwright's pipe transport), parent of the browsers it launches
            owner.driver_pid = pw._impl_obj._connection._transport._proc.pid
    return pw


def patch_browsergym() -> None:
    """Point BrowserGym's playwright lookup (bound by name in its env and chat modules) at the per-thread one."""
    if _PATCHED:
        return
    import browsergym.core.chat as chat
    import browsergym.core.env as genv

    for mod in (genv, chat):
        if not hasattr(mod, "_get_global_playwright"):
            raise RuntimeError(f"{mod.__name__} has no _get_global_playwright: browsergym-core must be 0.14.x")
        mod._get_global_playwright = _thread_playwright
    _PATCHED["done"] = True


class CallTimeout(TimeoutError):
    """A call on a :class:`Worker` did not return in time (it may still be running there)."""


class Worker:
    """A daemon thread running the calls given to :meth:`call`, in order; its playwright stops with it."""

    def __init__(self):
        self.driver_pid: int | None = None
        self.killed = False
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="esopt-web-browser", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        _LOCAL.worker = self
        while (item := self._q.get()) is not None:
            fn, fut = item
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
        pw, _LOCAL.pw = getattr(_LOCAL, "pw", None), None
        if pw is not None and not self.killed:  # a killed driver cannot be stopped
            try:
                pw.stop()
            except Exception as e:  # noqa: BLE001
                log.warning("stopping playwright: %s: %s", type(e).__name__, e)

    def call(self, fn, /, *args, timeout_s: float | None = None, **kwargs):
        """``fn(*args, **kwargs)`` on this worker's thread; its result, or its exception raised here.

        Past ``timeout_s`` seconds: :class:`CallTimeout`, the call still running (the caller kills the worker).
        """
        if threading.current_thread() is self._thread:  # e.g. a close from __del__ run by this thread's gc
            return fn(*args, **kwargs)
        if self.killed:
            raise RuntimeError("browser worker was killed")
        fut: Future = Future()
        self._q.put((functools.partial(fn, *args, **kwargs), fut))
        try:
            return fut.result(timeout_s)
        except FutureTimeout:
            raise CallTimeout(f"no answer in {timeout_s:g} s") from None

    def kill(self, timeout: float = 10.0) -> int:
        """Kill this worker's playwright driver and every process under it (its browsers), so that a stuck call
        raises and the thread ends; the worker is never reused. Returns how many processes were killed."""
        self.killed = True
        self._q.put(None)
        if self.driver_pid is None:
            return 0
        try:
            root = psutil.Process(self.driver_pid)
            procs = root.children(recursive=True) + [root]
        except psutil.NoSuchProcess:
            return 0
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=timeout)  # reaps the driver (our child); the browsers go to init
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return len(procs)

    def alive(self) -> bool:
        return self._thread.is_alive() and not self.killed

    def stop(self, timeout: float = 30.0) -> None:
        self._q.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


def lease() -> Worker:
    """An idle worker, else a new one."""
    with _LOCK:
        while _IDLE:
            w = _IDLE.pop()
            if w.alive():
                return w
    return Worker()


def release(w: Worker) -> None:
    with _LOCK:
        _IDLE.append(w)


def stop_idle(timeout: float = 30.0) -> int:
    """Stop every idle worker and its playwright driver, waiting ``timeout`` s at most in all; returns how many."""
    with _LOCK:
        ws, _IDLE[:] = list(_IDLE), []
    for w in ws:  # all at once: a driver whose pipes a forked process still holds never confirms its stop
        w._q.put(None)
    deadline = time.monotonic() + timeout
    for w in ws:
        if threading.current_thread() is not w._thread:
            w._thread.join(max(0.0, deadline - time.monotonic()))
    return len(ws)
