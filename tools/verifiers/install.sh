#!/usr/bin/env bash
# A venv with verifiers beside this project's, for objective.callable=esopt_mp.agent.harnesses.verifiers_v1:play
# and tests/integration/test_verifiers_harness.py.
#   tools/verifiers/install.sh [VENV]       (default .venv-verifiers; CI's verifiers stage runs it)
# verifiers pins openai<3 (and its own mcp): in a venv of its own it holds those, and sees the torch, esopt_mp,
# pytest and reasoning-gym of the python3 that made it (--system-site-packages, and the venv it runs in, if any).
set -euo pipefail
venv="${1:-.venv-verifiers}"
python3 -m venv --system-site-packages "$venv"
py="$venv/bin/python"
# made from inside a venv: that venv's packages are seen too (after the new venv's own, before the system's)
parent="$(python3 -c 'import sys, sysconfig; print(sysconfig.get_paths()["purelib"] if sys.prefix != sys.base_prefix else "")')"
if [ -n "$parent" ]; then
  echo "import site; site.addsitedir('$parent')" > "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_esopt_parent_env.pth"
fi
"$py" -m pip install -q "verifiers==${ESOPT_VERIFIERS_VERSION:-0.4.0}"
"$py" -c "import verifiers, verifiers.v1, openai; print('verifiers', verifiers.__version__, 'openai', openai.__version__, 'ok')"
