"""The interpreter every sandboxed call runs: the trainer's own Python (a venv stays a venv), its import path, the
``python`` shims that tools started inside resolve to, and everything it reads, shown read-only; whether a
per-call uid can reach those paths, and where a module the sandbox cannot import comes from (for messages).
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import glob
import importlib.util
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading

log = logging.getLogger(__name__)
_LOCK = threading.Lock()


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
            shutil.rmtree(d, ignore_errors=True)


def ro_paths() -> list[str]:
    """Directories (and files) the sandbox shows read-only: system libraries and the trainer's interpreter."""
    return list(interpreter().ro)


def sandbox_env(py: Interpreter, home: str) -> dict[str, str]:
    return {"PATH": f"{py.shims}:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "PYTHONNOUSERSITE": "1",
            "LANG": "C.UTF-8", **dict(py.env)}


def found_in(module: str) -> str:
    """Where the trainer imports ``module`` from (the import-path entry), for messages."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return "(the trainer cannot import it either)"
    top = os.path.dirname(spec.origin)
    return f"from {os.path.dirname(top) if spec.submodule_search_locations else top}"


def unreachable(paths, bound: bool) -> tuple[str, str] | None:
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
