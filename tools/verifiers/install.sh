#!/usr/bin/env bash
# A venv with verifiers beside this project's, for objective.callable=esopt_mp.agent.harnesses.verifiers_v1:play
# and tests/integration/test_verifiers_harness.py.
#   tools/verifiers/install.sh [VENV]       (default .venv-verifiers; CI's verifiers stage runs it)
# verifiers pins openai<3 (and its own mcp): in a venv of its own it holds those, and sees the torch, esopt_mp,
# pytest and reasoning-gym of the python3 that made it (--system-site-packages, and the venv it runs in, if any).
set -euo pipefail
venv="${1:-.venv-verifiers}"
"$(dirname "$0")/../venv_beside.sh" "$venv"
py="$venv/bin/python"
"$py" -m pip install -q "verifiers==${ESOPT_VERIFIERS_VERSION:-0.4.0}"
"$py" -c "import verifiers, verifiers.v1, openai; print('verifiers', verifiers.__version__, 'openai', openai.__version__, 'ok')"
