"""Level selection, the command for each level, and the two ways to run code (one shot, request/reply session).

What each level confines (every level also applies: wall clock, CPU, memory, per-call process count, file size,
open files, an output cap, a total byte cap, the kill of every process the call started, and -- as root -- a
fresh per-call uid that owns nothing):

- ``bwrap``: user/mount/PID/net/IPC namespaces; only the Python installation and system libraries visible,
  read-only; /tmp is a private tmpfs of ``total_mb`` and the only writable place.
- ``unshare``: own network, PID and IPC namespaces (util-linux ``unshare``; a user namespace when not root),
  Landlock (read-only Python and system libraries, a private 0700 scratch directory, nothing else; no TCP) and
  seccomp (no sockets; no limits, priorities or affinity of another pid; no System V IPC). Bytes written are
  capped by a watchdog on the scratch directory.
- ``rlimit``: no namespaces: Landlock and seccomp as above, signals kept inside the Landlock domain, and a
  subreaper bootstrap that kills every descendant. Needs Landlock ABI 6 (Linux 6.12) when not root.

Every level runs the trainer's own interpreter (``sys.executable``: a venv stays a venv) with the trainer's import
path -- its ``PYTHONPATH``, then what the interpreter itself finds (venv, conda, system site-packages and their
``.pth`` entries; never the working directory or the user site) -- all of it read-only. ``python``/``python3``
started inside (bash tools, shebang scripts) resolve to a shim that runs the same interpreter with the same
``PYTHONPATH``. Every level also keeps the code's hands off other processes: no signals, ptrace, ``/proc/<pid>``
writes, resource limits, priorities, CPU affinity or System V IPC of anything outside the call (namespaces, the
per-call uid, Landlock scoping and seccomp, whichever the level has).

A level is used only if a probe that runs exactly what a call runs (same command, same uid, same confinement)
succeeds; otherwise it is unavailable and the reason is kept. Nothing runs below ``min_level``.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading

from esopt_mp.envs.sandbox.config import (LEVELS, SandboxConfig, SandboxLimits, SandboxResult, SandboxStartError,
                                         SandboxUnavailable)
from esopt_mp.envs.sandbox.interpreter import found_in, interpreter, ro_paths, sandbox_env, unreachable
from esopt_mp.envs.sandbox.process import Running

log = logging.getLogger(__name__)
CHILD = open(os.path.join(os.path.dirname(__file__), "_child.py")).read()
UID_BASE = 1 << 30  # per-call uids: UID_BASE + (pid << 8 | counter), unique among live processes on the node
_COUNTER = itertools.count()
_PROBE = "import numpy, os, socket\nopen('probe', 'w').write('x')\nprint('ok', os.getuid())"
_LOCK = threading.Lock()
_DETECTED: dict[tuple, dict[str, str | None]] = {}
WORKSPACE = "/workspace"  # under bwrap, a call given ``files`` also sees its working directory here


def _bwrap(root: bool, limits: SandboxLimits, files: dict[str, str] | None = None) -> list[str]:
    cmd = ["bwrap", "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid", "--unshare-net",
           "--unshare-uts", "--unshare-cgroup-try", "--proc", "/proc", "--dev", "/dev",
           "--size", str(limits.total_mb << 20), "--perms", "1777", "--tmpfs", "/tmp", "--clearenv"]
    for k, v in sandbox_env(interpreter(), "/tmp").items():
        cmd += ["--setenv", k, v]
    # root: no user namespace (in one, the sandbox's uid would be root outside); the bootstrap drops to the
    # per-call uid, which needs setuid and searchable parents of the bound paths
    caps = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_CHOWN"]
    cmd += caps if root else ["--unshare-user"]
    made = {"/", "/tmp"}  # /tmp is the tmpfs above: what lies below it (a venv, the shims) is bound into it
    for link in ("/lib", "/lib64", "/lib32", "/bin", "/sbin"):  # merged-/usr systems: keep the symlinks
        if os.path.islink(link):
            cmd += ["--symlink", os.readlink(link), link]
    for p in ro_paths():
        parent = os.path.dirname(p)
        chain = []
        while parent not in made:
            chain.append(parent)
            made.add(parent)
            parent = os.path.dirname(parent)
        for d in reversed(chain):
            cmd += ["--perms", "0755", "--dir", d]
        cmd += ["--ro-bind", p, p]
    for name, host in (files or {}).items():  # read-only inputs in the private /tmp, also reachable as WORKSPACE
        cmd += ["--ro-bind", host, f"/tmp/{name}"]
    if files:
        cmd += ["--symlink", "/tmp", WORKSPACE]
    return cmd + ["--remount-ro", "/"]


class Sandbox:
    """``run_python(code)`` / ``session(code)`` in a fresh process with the limits and the strongest isolation."""

    def __init__(self, limits: SandboxLimits | None = None, level: str = "auto", min_level: str = "rlimit",
                 key: str = "env.sandbox"):
        self.limits = limits or SandboxLimits()
        self.root = os.geteuid() == 0
        SandboxConfig(level=level, min_level=min_level).validate(key)  # ValueError naming the key
        allowed = LEVELS[: LEVELS.index(min_level) + 1]
        wanted = allowed if level == "auto" else (level,)
        ok = [lv for lv in wanted if probe(lv) is None][:1]  # probe stops at the first level that works
        if not ok:
            reasons = {lv: probe(lv) for lv in wanted}
            why = "; ".join(f"{lv}: {r}" for lv, r in reasons.items())
            # the interpreter's own failures name their fix; the generic advice is for missing isolation tools
            python = ("the sandboxed interpreter", "the per-call uid cannot reach", "the trainer's interpreter")
            hint = ("" if all(r.startswith(python) for r in reasons.values()) else
                    f"; install bubblewrap, allow user namespaces, or lower {key}.min_level")
            raise SandboxUnavailable(f"{key}.min_level={min_level}: no sandbox level at or above it works here "
                                     f"({why}){hint}")
        self.level = ok[0]
        log.info("sandbox isolation level: %s (%s)", self.level, self.describe())

    @classmethod
    def from_config(cls, cfg: SandboxConfig | None, defaults: SandboxLimits | None = None,
                    key: str = "env.sandbox") -> "Sandbox":
        cfg = cfg or SandboxConfig()
        return cls(cfg.limits(defaults), cfg.level, cfg.min_level, key)

    def describe(self) -> str:
        base = "timeout, cpu, memory, per-call processes, file size, total bytes, output cap, descendants killed"
        extra = {"bwrap": "namespaces: network, pid, filesystem view (read-only Python, private sized /tmp)",
                 "unshare": "network, pid and IPC namespaces, Landlock filesystem, seccomp (no sockets, no "
                            "process by pid)",
                 "rlimit": "Landlock filesystem, signals and ptrace, seccomp (no sockets, no process by pid, no "
                           "System V IPC), subreaper kill (no namespaces)"}
        return f"blocks {base}; {extra[self.level]}" + ("; per-call uid" if self.root else "")

    # -- launching ---------------------------------------------------------------------------------------------
    def _launch(self, code: str, session: bool, level: str | None = None,
                files: dict[str, str] | None = None) -> tuple[Running | None, str | None]:
        level, lim = level or self.level, self.limits
        files = {n: os.path.realpath(h) for n, h in (files or {}).items()}
        if any("/" in n or n in ("", ".", "..") for n in files):
            raise ValueError(f"sandbox input names must be plain file names, got {sorted(files)}")  # the caller's bug
        uid = UID_BASE + ((os.getpid() << 8) | (next(_COUNTER) & 0xFF)) if self.root else None
        scratch = None
        if level != "bwrap":
            try:  # the host's side (a full /tmp): the infrastructure's failure, not the code's
                scratch = tempfile.mkdtemp(prefix="esopt_sbx_")  # 0700
                if uid is not None:
                    os.chown(scratch, uid, uid)
                for name, host in files.items():  # a link to the input; Landlock lets the code only read its dir
                    os.symlink(host, os.path.join(scratch, name))
            except OSError as e:
                _rm(scratch)
                return None, f"could not prepare the sandbox's scratch directory: {e}"
        cwd = "/tmp" if level == "bwrap" else scratch
        plan = {"rlimits": {"RLIMIT_CPU": lim.cpu_s, "RLIMIT_AS": lim.memory_mb << 20, "RLIMIT_CORE": 0,
                            "RLIMIT_FSIZE": lim.fsize_mb << 20, "RLIMIT_NOFILE": lim.nofile},
                "nproc": lim.nproc, "nproc_relative": level == "rlimit" and not self.root, "uid": uid, "cwd": cwd,
                "supervise": level == "rlimit", "seccomp": level != "bwrap", "own_cwd": level == "bwrap",
                "landlock": None if level == "bwrap" else {"ro": ro_paths() + sorted({os.path.dirname(h) for h in
                                                                                      files.values()}), "rw": [scratch],
                                                           "dev_rw": ["/dev/null", "/dev/zero", "/dev/urandom"],
                                                           "need_scope": level == "rlimit" and not self.root}}
        interp = interpreter()
        if interp.error:
            _rm(scratch)
            return None, interp.error
        plan["path"] = list(interp.path)
        rfd, wfd = os.pipe()
        plan["code_fd"] = rfd
        py = [interp.executable, "-I", "-c", CHILD, json.dumps(plan)]
        if level == "bwrap":
            cmd = _bwrap(self.root, lim, files) + py
        elif level == "unshare":
            ns = ["--net", "--pid", "--ipc", "--fork", "--kill-child"]
            cmd = ["unshare"] + ([] if self.root else ["--user", "--map-current-user"]) + ns + py
        else:
            cmd = py
        env = sandbox_env(interp, cwd)
        try:
            proc = subprocess.Popen(cmd, cwd=scratch or "/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, env=env, pass_fds=(rfd,),
                                    close_fds=True)
        except OSError as e:
            os.close(rfd)
            os.close(wfd)
            _rm(scratch)
            return None, f"could not start the sandbox: {e}"
        os.close(rfd)
        threading.Thread(target=_feed, args=(wfd, code.encode()), daemon=True).start()
        run = Running(proc, lim, scratch, session)
        run.scratch = scratch
        return run, None

    def run_python(self, code: str, stdin: str = "", level: str | None = None,
                   files: dict[str, str] | None = None) -> SandboxResult:
        """Run ``code`` to completion; never raises for anything the code does (:class:`SandboxStartError` if the
        sandbox itself cannot start).

        ``files`` ({name: host path}): read-only inputs that appear as ``name`` in the working directory (the host
        file's directory becomes readable to the code at the Landlock levels: give each input a private directory).
        """
        run, err = self._launch(code, session=False, level=level, files=files)
        if run is None:
            raise SandboxStartError(err)
        try:
            run.write(stdin.encode())
            return run.finish()
        finally:
            _rm(run.scratch)

    @contextlib.contextmanager
    def session(self, code: str):
        """A running ``code`` to talk to line by line (``ask``); its result (``result``) once the block ends."""
        run, err = self._launch(code, session=True)
        if run is None:
            raise SandboxStartError(err)
        s = Session(run, err)
        try:
            yield s
        finally:
            if run is not None:
                s.result = run.finish()
                _rm(run.scratch)


class Session:
    def __init__(self, run: Running | None, error: str | None):
        self.run, self.error, self.result = run, error, None

    def ask(self, line: str, max_bytes: int) -> str | None:
        """Send one request line; the reply line, or None if the process cannot answer (see ``failure``)."""
        if self.run is None or not self.run.write(line.encode() + b"\n"):
            return None
        return self.run.line(max_bytes)

    def failure(self) -> str:
        if self.run is None:
            return self.error or "sandbox did not start"
        if self.run.error:
            return self.run.error
        self.run.proc.poll()
        rc = self.run.proc.returncode
        tail = self.run.err.decode(errors="replace").strip().splitlines()[-1:]
        return f"the code stopped answering (exit status {rc})" + (f": {tail[0][:200]}" if tail else "")


def probe(level: str) -> str | None:
    """None if ``level`` works here for this user, else why not (cached per process, euid and interpreter)."""
    py = interpreter()
    key = (level, os.geteuid(), py.executable, py.path, py.env)
    with _LOCK:
        if key in _DETECTED:
            return _DETECTED[key]
    tool = {"bwrap": "bwrap", "unshare": "unshare"}.get(level)
    hidden = unreachable(py.ro, level == "bwrap") if os.geteuid() == 0 else None
    if tool and not shutil.which(tool):
        why = f"{tool} not found on PATH"
    elif py.error:
        why = py.error
    elif hidden:
        path, d = hidden
        why = (f"the per-call uid cannot reach the trainer's Python {path}: {d} is not searchable by others "
               f"(chmod o+x {d}" + (")" if level == "bwrap" else ", or use bwrap)"))
    else:
        sb = Sandbox.__new__(Sandbox)
        sb.limits, sb.root = SandboxLimits(wall_s=30, cpu_s=30), os.geteuid() == 0
        try:
            r = sb.run_python(_PROBE, level=level)
        except SandboxStartError as e:
            r = SandboxResult("", "", None, 0.0, str(e))
        words = r.stdout.split()
        why = r.error or (None if words[:1] == ["ok"] else f"unexpected probe output {r.stdout[:80]!r}")
        if why is None and sb.root and words[1:2] == ["0"]:
            why = "the code still ran as root"
        elif why and ("ModuleNotFoundError" in why or "ImportError" in why):
            why = f"the sandboxed interpreter {py.executable} cannot import numpy {found_in('numpy')}: {why}"
    with _LOCK:
        _DETECTED[key] = why
    if why:
        log.info("sandbox level %s unavailable: %s", level, why)
    return why


def _feed(wfd: int, data: bytes) -> None:
    with contextlib.suppress(OSError), os.fdopen(wfd, "wb") as f:
        f.write(data)


def _rm(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)
