"""Install, from a folder of wheels (tools/gpu_wheels.sh), the packages that do not import here; prints one JSON line.

    python tools/gpu_wheels_install.py DIR TARGET [MODULE=REQUIREMENT ...]
    python tools/gpu_wheels_install.py - TARGET     # no wheels: only say what is missing

For a node without network (tools/gpu_check.sh --wheels DIR). A module counts as missing if it does not import,
or if its distribution's version is not one the requirement takes (an antlr4 runtime other than 4.9 breaks
omegaconf); only those are installed, with ``pip install --no-index --no-deps --target TARGET`` (no root, no
network), and TARGET must then come first on PYTHONPATH, where it shadows a wrong version in site-packages.
Without pip the wheels are unpacked into TARGET, which is what installing a wheel amounts to. Each installed
module is then imported to tell whether it works. The modules checked are esopt_mp's core dependencies that a
CUDA image with torch and transformers may lack, or those given as MODULE=REQUIREMENT
(``antlr4=antlr4-python3-runtime==4.9.*``).
"""
from __future__ import annotations

import glob
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

# import name -> the distribution and the versions that do (an antlr4 runtime other than 4.9 fails omegaconf's
# grammar at import); the first five are what tools/gpu_wheels.sh downloads, the rest come with its --plots
MODULES = {"hydra": "hydra-core>=1.3,<1.4", "omegaconf": "omegaconf>=2.3,<2.4",
           "antlr4": "antlr4-python3-runtime==4.9.*", "yaml": "PyYAML>=5.1", "tqdm": "tqdm>=4.66",
           "matplotlib": "matplotlib>=3.7", "PIL": "pillow>=10", "contourpy": "contourpy", "cycler": "cycler",
           "fontTools": "fonttools", "kiwisolver": "kiwisolver", "pyparsing": "pyparsing",
           "dateutil": "python-dateutil", "six": "six"}


def _split(requirement: str) -> tuple[str, str]:
    """("hydra-core", ">=1.3,<1.4") from "hydra-core>=1.3,<1.4"."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)$", requirement)
    if not m:
        raise ValueError(f"not a requirement: {requirement!r}")
    return m.group(1), m.group(2).strip()


def why_missing(module: str, requirement: str) -> str | None:
    """None if ``module`` imports from a distribution that meets ``requirement``, else why not."""
    if importlib.util.find_spec(module) is None:
        return "not installed"
    dist, spec = _split(requirement)
    if not spec:
        return None
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None  # importable from somewhere without metadata: taken as it is
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:
        return None  # nothing to compare with
    return None if SpecifierSet(spec).contains(version, prereleases=True) else f"{dist} {version}, needs {spec}"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_for(folder: str, dist: str) -> str | None:
    """The newest-looking wheel of ``dist`` in ``folder`` (wheel names normalise - and . to _), else None."""
    found = [w for w in glob.glob(os.path.join(folder, "*.whl"))
             if _norm(os.path.basename(w).split("-")[0]) == _norm(dist)]
    return sorted(found)[-1] if found else None


def _unpack(wheels: list[str], target: str) -> None:
    """A wheel's root is site-packages; NAME.data/purelib and platlib go there too (scripts and headers do not)."""
    os.makedirs(target, exist_ok=True)
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            z.extractall(target)
        for data in glob.glob(os.path.join(target, "*.data")):
            for sub in ("purelib", "platlib"):
                src = os.path.join(data, sub)
                if os.path.isdir(src):
                    shutil.copytree(src, target, dirs_exist_ok=True)
            shutil.rmtree(data)


def install(folder: str, target: str, modules: dict[str, str]) -> dict:
    """Install into ``target`` the wheels in ``folder`` of each of ``modules`` (import name -> requirement) that does
    not import here in a version the requirement takes; then import each of them to tell whether it now works."""
    target = os.path.abspath(target)
    if target not in sys.path:
        sys.path.insert(0, target)  # what an earlier run installed there counts, and wins over site-packages
    importlib.invalidate_caches()
    missing = {m: r for m, r in modules.items() if why_missing(m, r)}
    folder = None if folder == "-" else os.path.abspath(folder)
    out: dict = {"wheels": folder, "target": target,
                 "missing": {_split(r)[0]: why_missing(m, r) for m, r in missing.items()}, "installed": [],
                 "no_wheel": []}
    if not missing:
        return out
    wheels = {}
    for dist in dict.fromkeys(_split(r)[0] for r in missing.values()):
        w = wheel_for(folder, dist) if folder else None
        if w is None:
            out["no_wheel"].append(dist)
        else:
            wheels[dist] = w
    if not wheels:
        return out
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", folder, "--no-deps",
           "--disable-pip-version-check", "--upgrade", "--target", target, *wheels.values()]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        ok, log = p.returncode == 0, (p.stdout + p.stderr)[-1500:]
    except (OSError, subprocess.TimeoutExpired) as e:
        ok, log = False, f"{type(e).__name__}: {e}"
    out["method"] = "pip --target"
    if not ok:  # no pip here, or pip refused: a wheel is a zip archive of site-packages
        out["pip_error_tail"] = log
        try:
            _unpack(list(wheels.values()), target)
            out["method"] = "unpacked"
        except Exception as e:  # noqa: BLE001 - reported, the check goes on without them
            out["error"] = f"{type(e).__name__}: {e}"
            return out
    importlib.invalidate_caches()
    out["installed"] = [os.path.basename(w) for w in wheels.values()]
    still = {}
    for m, r in missing.items():
        if _split(r)[0] not in wheels:
            continue
        try:
            importlib.import_module(m)  # a real import: a wrong antlr4 runtime fails only here
            reason = why_missing(m, r)
        except Exception as e:  # noqa: BLE001
            reason = f"{type(e).__name__}: {e}"
        if reason:
            still[_split(r)[0]] = reason
    out["still_missing"] = still
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2 or any("=" not in a for a in argv[2:]):
        print("usage:\n" + "\n".join(__doc__.splitlines()[2:4]), file=sys.stderr)
        return 2
    modules = dict(a.split("=", 1) for a in argv[2:]) or MODULES
    try:
        res = install(argv[0], argv[1], modules)
    except Exception as e:  # noqa: BLE001 - one JSON line whatever happens
        res = {"wheels": argv[0], "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(res))
    return 1 if res.get("error") or res.get("still_missing") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
