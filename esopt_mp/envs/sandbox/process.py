"""One sandboxed process: output pumps, a watchdog (wall clock, output, bytes written) and a tree kill.

The pumps read the raw pipe (``os.read``: whatever is there, never waiting for a full chunk), so output printed
before a kill is kept. The watchdog kills the whole process tree: descendants first (they re-parent to the
bootstrap's subreaper, or die with the PID namespace), the root last.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time

from esopt_mp.envs.sandbox.config import SandboxLimits, SandboxResult


def descendants(root: int) -> list[int]:
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError, ValueError):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
                out += kids
                todo += kids
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL every descendant of ``proc`` (repeatedly: a fork bomb keeps forking), then ``proc`` itself."""
    for _ in range(200):
        kids = descendants(proc.pid)
        if not kids:
            break
        for pid in kids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def disk_usage(path: str) -> int:
    """Bytes allocated below ``path`` (hard links counted once)."""
    seen, total, todo = set(), 0, [path]
    while todo:
        with contextlib.suppress(OSError), os.scandir(todo.pop()) as it:
            for e in it:
                with contextlib.suppress(OSError):
                    st = e.stat(follow_symlinks=False)
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_blocks * 512
                    if e.is_dir(follow_symlinks=False):
                        todo.append(e.path)
    return total


class Running:
    """A started sandbox process. ``line()`` for request/reply sessions, ``finish()`` for the result."""

    def __init__(self, proc: subprocess.Popen, limits: SandboxLimits, watch_dir: str | None, session: bool):
        self.proc, self.lim, self.watch_dir, self.session = proc, limits, watch_dir, session
        self.start = time.monotonic()
        self.out, self.err = bytearray(), bytearray()
        self.cond = threading.Condition()
        self.error: str | None = None
        self.closed = {"out": False, "err": False}
        self.threads = [threading.Thread(target=self._pump, args=(proc.stdout, "out"), daemon=True),
                        threading.Thread(target=self._pump, args=(proc.stderr, "err"), daemon=True),
                        threading.Thread(target=self._watch, daemon=True)]
        for t in self.threads:
            t.start()

    def _fail(self, error: str) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()
        kill_tree(self.proc)

    def _pump(self, stream, key: str) -> None:
        fd, buf = stream.fileno(), self.out if key == "out" else self.err
        cap = self.lim.output_bytes
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                with self.cond:
                    self.closed[key] = True
                    self.cond.notify_all()
                return
            with self.cond:
                room = cap - len(buf)
                buf += chunk[:max(room, 0)]
                self.cond.notify_all()
            if len(chunk) > room:
                self._fail(f"output exceeded {cap} bytes")

    def _watch(self) -> None:
        cap, deadline = self.lim.total_mb << 20, self.start + self.lim.wall_s
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                return self._fail(f"timeout after {self.lim.wall_s:g} s wall clock")
            if self.watch_dir and disk_usage(self.watch_dir) > cap:
                return self._fail(f"wrote more than env.sandbox.total_mb={self.lim.total_mb} MB")
            time.sleep(0.02)
        kill_tree(self.proc)  # the main process is gone: nothing it started may stay
        with self.cond:
            self.cond.notify_all()

    def write(self, data: bytes) -> bool:
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, ValueError, OSError):
            return False

    def line(self, max_bytes: int) -> str | None:
        """The next stdout line, or None (process ended, timed out or sent more than ``max_bytes`` unbroken)."""
        with self.cond:
            while True:
                i = self.out.find(b"\n")
                if i >= 0:
                    text = bytes(self.out[:i])
                    del self.out[:i + 1]
                    return text.decode(errors="replace")
                if self.error or self.closed["out"] or len(self.out) > max_bytes:  # EOF, not exit: read what it sent
                    return None
                self.cond.wait(0.05)

    def finish(self) -> SandboxResult:
        with contextlib.suppress(ValueError, OSError):
            self.proc.stdin.close()
        self.proc.wait()
        kill_tree(self.proc)
        for t in self.threads:
            t.join(timeout=2)
        rc, error = self.proc.returncode, self.error
        if error is None and rc != 0:
            error = _exit_reason(rc, self.err.decode(errors="replace"), self.lim, time.monotonic() - self.start)
        return SandboxResult(self.out.decode(errors="replace"), self.err.decode(errors="replace"), rc,
                             time.monotonic() - self.start, error)


def _exit_reason(rc: int, stderr: str, lim: SandboxLimits, elapsed_s: float = 0.0) -> str:
    import re

    lines = stderr.strip().splitlines()
    if rc in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return f"cpu limit of {lim.cpu_s} s exceeded"
    if rc == 1 and "unshare: sigprocmask unblock failed" in stderr:
        # util-linux unshare --fork passes its child's fatal signal on by re-raising it; that step sometimes fails
        # (EINVAL) and it exits 1 instead, so the signal is lost. Only the CPU limit kills after >= cpu_s.
        if elapsed_s >= lim.cpu_s:
            return f"cpu limit of {lim.cpu_s} s exceeded (killed by a signal unshare could not pass on)"
        return "killed by a signal (unshare could not pass it on)"
    error = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
    setup = [l for l in lines if l.startswith("sandbox setup failed")]
    # the exception line, not whatever a crowd of dying processes printed last
    exc = setup or [l for l in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", l)]
    return error + (f": {(exc or lines)[-1][:200]}" if lines else "")
