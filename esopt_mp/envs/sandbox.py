"""Run untrusted Python (agent tool calls, generated heuristics) in a separate, limited process.

Isolation levels, strongest available chosen at start-up and logged:

- ``bwrap``: bubblewrap namespaces -- no network (empty net namespace), own PID
  namespace, a read-only view of the Python installation and system libraries
  only (no /home, /root, /work, /etc), a private writable scratch directory, tmpfs /tmp;
- ``unshare``: ``unshare --net`` (no network), filesystem visible read-only by permissions;
- ``rlimit``: resource limits and a separate session only.

Every level applies: wall-clock timeout (the whole process group is killed),
CPU seconds, address space, process count, file size, an output cap, and --
when started as root -- a drop to an unprivileged user (root ignores the
process-count limit, and nobody cannot write outside the scratch directory).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

log = logging.getLogger(__name__)
LEVELS = ("bwrap", "unshare", "rlimit")
NOBODY = 65534


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    nproc: int = 32
    fsize_mb: int = 16
    output_bytes: int = 64 * 1024


@dataclasses.dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None
    seconds: float
    error: str | None = None  # timeout / output limit / killed by signal / nonzero exit

    @property
    def ok(self) -> bool:
        return self.error is None


def _can(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


_DETECTED: dict[bool, str] = {}


def detect_level(drop_privileges: bool) -> str:
    """Strongest level that works here (cached per process)."""
    if drop_privileges in _DETECTED:
        return _DETECTED[drop_privileges]
    probe = [sys.executable, "-c", "pass"]
    level = "rlimit"
    if shutil.which("bwrap") and _can(_bwrap_prefix("/tmp", drop_privileges) + probe):
        level = "bwrap"
    elif shutil.which("unshare") and _can(["unshare", "--net"] + probe):
        level = "unshare"
    _DETECTED[drop_privileges] = level
    return level


def _ro_paths() -> list[str]:
    paths = {"/usr", "/lib", "/lib64", "/bin", "/sbin", sys.base_prefix, sys.prefix}
    paths.update(p for p in sys.path if p and os.path.isdir(p) and "site-packages" in p)
    out = []
    for p in sorted(paths, key=len):
        if os.path.exists(p) and not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


class _PidsCgroup:
    """A pids cgroup (v1 or v2) capping the sandbox's process count; root cannot escape it."""

    ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")

    def __init__(self, limit: int, enabled: bool = True):
        self.path = None
        for root in self.ROOTS if enabled else ():
            if not os.path.isfile(os.path.join(root, "cgroup.procs")) or not os.access(root, os.W_OK):
                continue
            path = os.path.join(root, f"esopt_sbx_{os.getpid()}_{threading.get_ident()}_{time.monotonic_ns()}")
            try:
                os.mkdir(path)
                with open(os.path.join(path, "pids.max"), "w") as f:
                    f.write(str(limit))
            except OSError:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
                continue
            self.path = path
            return

    def join(self) -> None:  # in the child, before exec
        if self.path:
            with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    def close(self) -> None:
        if not self.path:
            return
        for _ in range(100):
            try:
                with open(os.path.join(self.path, "cgroup.procs")) as f:
                    pids = [int(x) for x in f.read().split()]
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.05)
        log.warning("could not remove sandbox cgroup %s", self.path)


def pids_cgroup_available() -> bool:
    cg = _PidsCgroup(1)
    ok = cg.path is not None
    cg.close()
    return ok


def _bwrap_prefix(scratch: str, drop: bool) -> list[str]:
    cmd = ["bwrap", "--die-with-parent", "--new-session", "--unshare-all", "--proc", "/proc", "--dev", "/dev",
           "--tmpfs", "/tmp", "--bind", scratch, "/scratch", "--chdir", "/scratch", "--clearenv",
           "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/scratch", "--setenv", "PYTHONNOUSERSITE", "1"]
    for p in _ro_paths():
        cmd += ["--ro-bind", p, p]
    if drop:
        cmd += ["--uid", str(NOBODY), "--gid", str(NOBODY)]
    return cmd + ["--remount-ro", "/"]


class Sandbox:
    """``run_python(code)`` in a fresh process with the limits and the strongest isolation available."""

    def __init__(self, limits: SandboxLimits | None = None, level: str = "auto"):
        self.limits = limits or SandboxLimits()
        self.drop = os.geteuid() == 0
        if level == "auto":
            level = detect_level(self.drop)
        if level not in LEVELS:
            raise ValueError(f"unknown sandbox level {level!r}; expected auto or one of {LEVELS}")
        self.level = level
        self.cgroup = pids_cgroup_available()
        log.info("sandbox isolation level: %s (%s)", level, self.describe())

    def describe(self) -> str:
        blocked = ["timeout", "cpu", "memory", "fsize", "output cap"]
        if self.cgroup or not self.drop:
            blocked.append("process count" + (" (pids cgroup)" if self.cgroup else " (RLIMIT_NPROC)"))
        if self.level in ("bwrap", "unshare"):
            blocked.append("network")
        if self.level == "bwrap":
            blocked.append("filesystem outside scratch (read and write)")
        elif self.drop:
            blocked.append("writes outside scratch (unprivileged user)")
        return "blocks " + ", ".join(blocked)

    def _preexec(self, cgroup: _PidsCgroup):
        lim = self.limits
        drop_here = self.drop and self.level != "bwrap"

        def fn():
            cgroup.join()
            resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1))
            resource.setrlimit(resource.RLIMIT_FSIZE, (lim.fsize_mb << 20, lim.fsize_mb << 20))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if self.level != "bwrap":  # bwrap itself needs address space for its setup; limit the child python
                resource.setrlimit(resource.RLIMIT_AS, (lim.memory_mb << 20, lim.memory_mb << 20))
            if drop_here:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            if not self.drop or drop_here:  # root ignores RLIMIT_NPROC: the cgroup covers that case
                resource.setrlimit(resource.RLIMIT_NPROC, (lim.nproc, lim.nproc))

        return fn

    def _command(self, scratch: str, script: str) -> list[str]:
        py = [sys.executable, "-I", "-c",
              f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({self.limits.memory_mb << 20}, "
              f"{self.limits.memory_mb << 20})); exec(compile(open({script!r}).read(), 'main.py', 'exec'))"]
        if self.level == "bwrap":
            return _bwrap_prefix(scratch, self.drop) + [py[0], "-I", "-c", py[3].replace(script, "/scratch/main.py")]
        if self.level == "unshare":
            return ["unshare", "--net"] + py
        return py

    def run_python(self, code: str, stdin: str = "") -> SandboxResult:
        lim = self.limits
        with tempfile.TemporaryDirectory(prefix="esopt_sbx_") as scratch:
            os.chmod(scratch, 0o777)
            script = os.path.join(scratch, "main.py")
            with open(script, "w") as f:
                f.write(code)
            start = time.monotonic()
            cgroup = _PidsCgroup(lim.nproc, enabled=self.cgroup)
            try:
                return self._run(scratch, script, stdin, start, cgroup)
            finally:
                cgroup.close()

    def _run(self, scratch: str, script: str, stdin: str, start: float, cgroup) -> SandboxResult:
        lim = self.limits
        proc = subprocess.Popen(self._command(scratch, script), cwd=scratch, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=self._preexec(cgroup), env={"PATH": "/usr/bin:/bin", "HOME": scratch,
                                                                 "PYTHONNOUSERSITE": "1", "LANG": "C.UTF-8"})
        bufs = {"out": bytearray(), "err": bytearray()}
        over = threading.Event()

        def pump(stream, key):
            while True:
                chunk = stream.read(65536)
                if not chunk:
                    return
                room = lim.output_bytes - len(bufs[key])
                if room > 0:
                    bufs[key] += chunk[:room]
                if len(chunk) > room:
                    over.set()

        threads = [threading.Thread(target=pump, args=(proc.stdout, "out"), daemon=True),
                   threading.Thread(target=pump, args=(proc.stderr, "err"), daemon=True)]
        for t in threads:
            t.start()
        try:
            proc.stdin.write(stdin.encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        error = None
        deadline = start + lim.wall_s
        while proc.poll() is None:
            if over.is_set():
                error = f"output exceeded {lim.output_bytes} bytes"
                break
            if time.monotonic() > deadline:
                error = f"timeout after {lim.wall_s:g} s wall clock"
                break
            time.sleep(0.01)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for t in threads:
            t.join(timeout=2)
        rc = proc.returncode
        if error is None and over.is_set():
            error = f"output exceeded {lim.output_bytes} bytes"
        if error is None and rc != 0:
            err_lines = bufs["err"].decode(errors="replace").strip().splitlines()
            error = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
            if rc == -signal.SIGXCPU or rc == 128 + signal.SIGXCPU:
                error = f"cpu limit of {lim.cpu_s} s exceeded"
            elif err_lines:
                # the exception line, not whatever a crowd of dying processes printed last
                exc = [l for l in err_lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", l)]
                error += f": {(exc or err_lines)[-1][:200]}"
        return SandboxResult(bufs["out"].decode(errors="replace"), bufs["err"].decode(errors="replace"), rc,
                             time.monotonic() - start, error)
