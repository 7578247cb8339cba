"""The learning benchmark's runs as child processes, a few at a time, that stop as a whole.

Each run is ``launch/train.py`` in its own session (a terminal's Ctrl-C reaches the benchmark only) with its pid in
``run_dir/bench.pid``, so a second benchmark over the same ``--out`` does not start a run that is still going. A stop
(:meth:`Jobs.request_stop`, the benchmark's SIGTERM/SIGINT/SIGHUP handler) sends SIGTERM to every run, including one
launched as the stop came in: each finishes its step, saves and exits 75, and the same command resumes them.
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
    try:  # a reused pid is some other program: its command line does not name this run dir
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return pid if f"run.dir={run_dir}".encode() in f.read() else None
    except OSError:
        return pid  # no /proc here: trust the signal check


def _term(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)  # not Popen.send_signal: its poll() would reap the child before wait4 does
    except ProcessLookupError:
        pass


class Jobs:
    def __init__(self):
        self.running: dict[int, tuple] = {}  # pid -> (key, run_dir, start time, log file)
        self.stopping = False

    def request_stop(self, signum=None, frame=None) -> None:
        """A signal handler: no run starts any more and each running one is told to stop after its step."""
        self.stopping = True
        for pid in list(self.running):
            _term(pid)

    def start(self, key, run_dir: str, cmd: list[str], cwd: str, env: dict) -> None:
        pid = live_pid(run_dir)
        if pid is not None:
            raise AlreadyRunning(f"{run_dir} is still running (pid {pid}): wait for it or stop it first")
        os.makedirs(run_dir, exist_ok=True)
        log = open(os.path.join(run_dir, "bench.log"), "ab")
        log.write((" ".join(cmd) + "\n").encode())
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        with open(os.path.join(run_dir, "bench.pid"), "w") as f:
            f.write(f"{proc.pid}\n")
        self.running[proc.pid] = (key, run_dir, time.perf_counter(), log)
        if self.stopping:  # the stop came in as this one started
            _term(proc.pid)

    def reap(self) -> tuple:
        """Wait for a run to end: (key, run_dir, exit status, wall seconds, peak RSS bytes, stopped by a request)."""
        while True:
            pid, status, usage = os.wait4(-1, 0)
            if pid in self.running:
                break
        key, run_dir, t0, log = self.running.pop(pid)
        log.close()
        try:
            os.remove(os.path.join(run_dir, "bench.pid"))
        except OSError:
            pass
        code = os.waitstatus_to_exitcode(status)
        # 75: stopped after its checkpoint; killed by our SIGTERM before its run loop began: nothing lost either
        stopped = code == 75 or (self.stopping and code == -signal.SIGTERM)
        return key, run_dir, code, time.perf_counter() - t0, usage.ru_maxrss * 1024, stopped

    def stop_all(self) -> None:
        """Stop every run and wait for each (the benchmark is going away: none is left running on its own)."""
        self.request_stop()
        while self.running:
            self.reap()
