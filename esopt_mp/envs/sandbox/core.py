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

import atexit
import contextlib
import glob
import dataclasses
import importlib.util
import itertools
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading

from esopt_mp.envs.sandbox.config import (LEVELS, SandboxConfig, SandboxLimits, SandboxResult, SandboxStartError,
                                         SandboxUnavailable)
from esopt_mp.envs.sandbox.process import Running

log = logging.getLogger(__name__)
CHILD = open(os.path.join(os.path.dirname(__file__), "_child.py")).read()
UID_BASE = 1 << 30  # per-call uids: UID_BASE + (pid << 8 | counter), unique among live processes on the node
_COUNTER = itertools.count()
_PROBE = "import numpy, os, socket\nopen('probe', 'w').write('x')\nprint('ok', os.getuid())"
_LOCK = threading.Lock()
_DETECTED: dict[tuple, dict[str, str | None]] = {}
WORKSPACE = "/workspace"  # under bwrap, a call given ``files`` also sees its working directory here


@dataclasses.dataclass(frozen=True)
class Interpreter:
    """The trainer's Python as every sandboxed call, and every ``python3`` it starts, runs it."""

    executable: str  # sys.executable, its directory resolved; a venv's bin/python link is kept (pyvenv.cfg)
    path: tuple[str, ...]  # the import path: PYTHONPATH entries, then the interpreter's own (-I) path
    env: tuple[tuple[str, str], ...]  # PYTHONPATH / LD_LIBRARY_PATH for tools started inside
    shims: str  # python, python3, python3.X: scripts that exec ``executable``; first on the sandbox's PATH
    ro: tuple[str, ...]  # everything the interpreter reads: its files, its import path, the shims
    error: str | None = None  # why it cannot be started as the sandbox starts it


_INTERPRETERS: dict[tuple, Interpreter] = {}


def _entries(var: str) -> list[str]:
    """Absolute, existing, resolved entries of a path-list variable (empty entries mean the cwd: left out)."""
    if sys.flags.ignore_environment and var == "PYTHONPATH":
        return []
    out = []
    for p in os.environ.get(var, "").split(os.pathsep):
        if p and os.path.exists(p):
            real = os.path.realpath(p)
            if real not in out:
                out.append(real)
    return out


def interpreter() -> Interpreter:
    """The trainer's interpreter and import path (cached per executable and environment)."""
    exe = sys.executable or ""
    key = (exe, os.environ.get("PYTHONPATH"), os.environ.get("LD_LIBRARY_PATH"), sys.flags.ignore_environment)
    with _LOCK:
        if key in _INTERPRETERS:
            return _INTERPRETERS[key]
    exe = os.path.join(os.path.realpath(os.path.dirname(exe)), os.path.basename(exe)) if exe else ""
    pythonpath, ld = _entries("PYTHONPATH"), _entries("LD_LIBRARY_PATH")
    env = tuple((k, os.pathsep.join(v)) for k, v in (("PYTHONPATH", pythonpath), ("LD_LIBRARY_PATH", ld)) if v)
    own, error = [], None
    try:  # the path the interpreter finds itself, exactly as the sandbox starts it (-I)
        q = subprocess.run([exe, "-I", "-c", "import json, sys; print(json.dumps(sys.path))"], capture_output=True,
                           text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **dict(env)})
        if q.returncode:
            error = f"the trainer's interpreter {exe} does not start with -I: {q.stderr.strip()[-200:]}"
        else:
            own = [p for p in json.loads(q.stdout) if p]
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        error = f"the trainer's interpreter {exe!r} cannot be started: {e}"
    path = tuple(dict.fromkeys(pythonpath + own))
    files = [exe]  # the interpreter and every link on the way to the binary
    while files[-1] and os.path.islink(files[-1]) and len(files) < 40:
        files.append(os.path.join(os.path.dirname(files[-1]), os.readlink(files[-1])))
    shims = _shims(exe)
    ro = {"/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", sys.base_prefix, sys.prefix, sys.exec_prefix,
          sys.base_exec_prefix, shims, *path, *ld, *(os.path.dirname(f) for f in files if f), *_library_dirs()}
    ro_paths, scratch = [], {"/tmp", os.path.realpath(tempfile.gettempdir())}
    for p in sorted({os.path.realpath(p) for p in ro if p and os.path.exists(p)}, key=len):
        if any(t == p or t.startswith(p.rstrip("/") + "/") for t in scratch):  # e.g. PYTHONPATH=/tmp
            log.warning("sandbox: %s is not shown to sandboxed code (it holds the scratch directories)", p)
        elif not any(p == q or p.startswith(q.rstrip("/") + "/") for q in ro_paths):
            ro_paths.append(p)
    out = Interpreter(exe, path, env, shims, tuple(ro_paths), error)
    with _LOCK:
        _INTERPRETERS[key] = out
    return out


def _library_dirs() -> set[str]:
    """Where the trainer's shared libraries live beyond the usual places: the folders of those it has loaded (an
    extension found through its RPATH, as HPC module trees build them) and the loader's configured folders."""
    dirs = set()
    with contextlib.suppress(OSError), open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lib = parts[5].strip() if len(parts) == 6 else ""
            if lib.startswith("/") and ".so" in os.path.basename(lib) and not lib.endswith("(deleted)"):
                dirs.add(os.path.dirname(lib))
    confs, seen = ["/etc/ld.so.conf"], set()
    while confs:
        conf = confs.pop()
        if conf in seen:
            continue
        seen.add(conf)
        with contextlib.suppress(OSError), open(conf) as f:
            for line in f:
                line = line.split("#", 1)[0].strip()
                if line.startswith("include "):
                    confs += glob.glob(os.path.join(os.path.dirname(conf), line.split(None, 1)[1]))
                elif line.startswith("/"):
                    dirs.add(line)
    return {d for d in dirs if not d.startswith(("/dev", "/proc", "/sys"))}


_SHIM_DIRS: list[str] = []


def _shims(exe: str) -> str:
    """A private 0755 directory of ``python`` shims for ``exe`` (a script, not a link: a link to a venv's python
    would lose the venv, which Python finds next to the path it was started by); removed at exit."""
    d = tempfile.mkdtemp(prefix="esopt_sbx_python_")
    os.chmod(d, 0o755)
    v = sys.version_info
    for name in ("python", "python3", f"python{v.major}.{v.minor}"):
        with open(os.path.join(d, name), "w") as f:
            f.write(f"#!/bin/sh\nexec {shlex.quote(exe)} \"$@\"\n")
        os.chmod(os.path.join(d, name), 0o755)
    if not _SHIM_DIRS:
        atexit.register(_rm_shims, os.getpid())
    _SHIM_DIRS.append(d)
    return d


def _rm_shims(owner: int) -> None:
    if os.getpid() == owner:  # not in a forked child that inherited the list
        for d in _SHIM_DIRS:
            _rm(d)


def _ro_paths() -> list[str]:
    """Directories (and files) the sandbox shows read-only: system libraries and the trainer's interpreter."""
    return list(interpreter().ro)


def _env(py: Interpreter, home: str) -> dict[str, str]:
    return {"PATH": f"{py.shims}:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "PYTHONNOUSERSITE": "1",
            "LANG": "C.UTF-8", **dict(py.env)}


def _bwrap(root: bool, limits: SandboxLimits, files: dict[str, str] | None = None) -> list[str]:
    cmd = ["bwrap", "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid", "--unshare-net",
           "--unshare-uts", "--unshare-cgroup-try", "--proc", "/proc", "--dev", "/dev",
           "--size", str(limits.total_mb << 20), "--perms", "1777", "--tmpfs", "/tmp", "--clearenv"]
    for k, v in _env(interpreter(), "/tmp").items():
        cmd += ["--setenv", k, v]
    # root: no user namespace (in one, the sandbox's uid would be root outside); the bootstrap drops to the
    # per-call uid, which needs setuid and searchable parents of the bound paths
    caps = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_CHOWN"]
    cmd += caps if root else ["--unshare-user"]
    made = {"/", "/tmp"}  # /tmp is the tmpfs above: what lies below it (a venv, the shims) is bound into it
    for link in ("/lib", "/lib64", "/lib32", "/bin", "/sbin"):  # merged-/usr systems: keep the symlinks
        if os.path.islink(link):
            cmd += ["--symlink", os.readlink(link), link]
    for p in _ro_paths():
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
                "landlock": None if level == "bwrap" else {"ro": _ro_paths() + sorted({os.path.dirname(h) for h in
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
        env = _env(interp, cwd)
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
    hidden = _hidden(py.ro, level == "bwrap") if os.geteuid() == 0 else None
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
            why = f"the sandboxed interpreter {py.executable} cannot import numpy {_found_in('numpy')}: {why}"
    with _LOCK:
        _DETECTED[key] = why
    if why:
        log.info("sandbox level %s unavailable: %s", level, why)
    return why


def _found_in(module: str) -> str:
    """Where the trainer imports ``module`` from (the import-path entry), for messages."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return "(the trainer cannot import it either)"
    top = os.path.dirname(spec.origin)
    return f"from {os.path.dirname(top) if spec.submodule_search_locations else top}"


def _hidden(paths, bound: bool) -> tuple[str, str] | None:
    """(path, directory) for the first path whose way there others cannot traverse. ``bound`` (bwrap): the
    sandbox makes the parents itself, so only the path's own directory counts."""
    for p in paths:
        d = p if os.path.isdir(p) else os.path.dirname(p)
        try:
            bad = _unsearchable(d) if not bound else (None if os.stat(d).st_mode & 0o001 else d)
        except OSError:
            bad = None
        if bad:
            return p, bad
    return None


def _unsearchable(path: str) -> str | None:
    """The first directory on the way to ``path`` that others cannot traverse, if any."""
    parts = os.path.realpath(path).split("/")[1:]
    for i in range(1, len(parts) + 1):
        d = "/" + "/".join(parts[:i])
        with contextlib.suppress(OSError):
            if not os.stat(d).st_mode & 0o001:
                return d
    return None


def _feed(wfd: int, data: bytes) -> None:
    with contextlib.suppress(OSError), os.fdopen(wfd, "wb") as f:
        f.write(data)


def _rm(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)
