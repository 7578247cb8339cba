"""The learning benchmark's runs as child processes, a few at a time, that stop as a whole.

Each run is ``launch/train.py`` in its own session (a terminal's Ctrl-C reaches the benchmark only) with its pid in
``run_dir/bench.pid``, so a second benchmark over the same ``--out`` does not start a run that is still going. A stop
(:meth:`Jobs.request_stop`, the benchmark's SIGTERM/SIGINT/SIGHUP handler) sends SIGTERM to every run, including one
launched as the stop came in: each finishes its step, saves and exits 75, and the same command resumes them. A second
signal kills the runs (each loses the step it was in).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time


class AlreadyRunning(RuntimeError):
    """A run dir whose run is still going (another benchmark's child, or one left by a benchmark that died)."""


def live_pid(run_dir: str) -> int | None:
    """The pid of the run still going in ``run_dir``, else None."""
    try:
        with open(os.path.join(run_dir, "bench.pid")) as f:
            pid = int(f.read().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    if not os.path.isdir("/proc"):
        return pid  # no /proc here: trust the signal check
    try:  # a reused pid is another program: its arguments name no such run dir
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return None
    return pid if f"run.dir={run_dir}".encode() in args else None


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)  # not Popen.send_signal: its poll() would reap the child before wait4 does
    except ProcessLookupError:
        pass


class Jobs:
    def __init__(self):
        self.running: dict[int, tuple] = {}  # pid -> (key, run_dir, start time, log file, Popen)
        self.stopping = 0  # stop requests so far

    def request_stop(self, signum=None, frame=None) -> None:
        """A signal handler: no run starts any more and each running one is told to stop after its step; a second
        request kills them."""
        self.stopping += 1
        sig = signal.SIGTERM if self.stopping == 1 else signal.SIGKILL
        os.write(2, b"[bench_learning] stopping: each run finishes its step and saves; the same command resumes "
                    b"them (a second signal kills them)\n" if sig == signal.SIGTERM else
                    b"[bench_learning] killing the runs\n")  # not print: a handler must not reenter buffered I/O
        self._signal_all(sig)

    def _signal_all(self, sig: int) -> None:
        for pid in list(self.running):
            _signal(pid, sig)

    def start(self, key, run_dir: str, cmd: list[str], cwd: str, env: dict) -> bool:
        """Launch a run (False: a stop came first, none launched)."""
        if self.stopping:
            return False
        pid = live_pid(run_dir)
        if pid is not None:
            raise AlreadyRunning(f"{run_dir} is still running (pid {pid}): wait for it or stop it first")
        os.makedirs(run_dir, exist_ok=True)
        log = open(os.path.join(run_dir, "bench.log"), "ab")
        log.write((" ".join(cmd) + "\n").encode())
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        # kept (not dropped): a dropped Popen is reaped by the next Popen, and wait4 would never see it end
        self.running[proc.pid] = (key, run_dir, time.perf_counter(), log, proc)
        if self.stopping:  # the stop came in as this one started
            _signal(proc.pid, signal.SIGTERM)
        with open(os.path.join(run_dir, "bench.pid"), "w") as f:
            f.write(f"{proc.pid}\n")
        return True

    def reap(self) -> tuple:
        """Wait for a run to end: (key, run_dir, exit status, wall seconds, peak RSS bytes, stopped by a request)."""
        while True:
            pid, status, usage = os.wait4(-1, 0)
            if pid in self.running:
                break
        key, run_dir, t0, log, proc = self.running.pop(pid)
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        log.close()
        try:
            os.remove(os.path.join(run_dir, "bench.pid"))
        except OSError:
            pass
        # 75: stopped after its checkpoint; killed by our SIGTERM before its run loop began: nothing lost either
        stopped = code == 75 or (self.stopping > 0 and code == -signal.SIGTERM)
        return key, run_dir, code, time.perf_counter() - t0, usage.ru_maxrss * 1024, stopped

    def stop_all(self) -> None:
        """Stop every run and wait for each (the benchmark is going away: none is left running on its own); a
        signal while it waits kills them."""
        self.stopping = max(self.stopping, 1)
        self._signal_all(signal.SIGTERM)
        while self.running:
            self.reap()
