#!/usr/bin/env bash
# The wheels tools/gpu_check.sh needs on a GPU node without network, downloaded here (a machine with PyPI) into DIR:
# the core dependencies of esopt_mp that a CUDA image with torch, transformers, accelerate and the like lacks
# (hydra-core and what it needs). All for CPython 3.12 on x86-64 Linux; pure-python wheels serve any platform.
#
#   bash tools/gpu_wheels.sh DIR [--plots]     # --plots: also matplotlib, pillow and their dependencies
#
# Copy DIR to the node beside the checkout and run `ESOPT_WHEELS=DIR bash tools/gpu_check.sh` (or
# `bash tools/gpu_check.sh --wheels DIR`): it installs from DIR only what does not import there.
# Prints DIR's size; fails if it is over 64 MiB (what such a node takes along).
set -euo pipefail
dir="${1:?usage: bash tools/gpu_wheels.sh DIR [--plots]}"
plots="${2:-}"
py="${PYTHON:-python3}"
# hydra-core 1.3 takes omegaconf 2.3 and antlr4-python3-runtime 4.9.* exactly (4.9.3 is published as a source
# archive only: built here into a pure-python wheel); PyYAML and tqdm are core dependencies too, usually already
# there with transformers
pkgs=("hydra-core>=1.3,<1.4" "omegaconf>=2.3,<2.4" "antlr4-python3-runtime==4.9.3" "PyYAML>=6" "tqdm>=4.66")
if [ "$plots" = "--plots" ]; then
  pkgs+=("matplotlib>=3.7" "pillow>=10" contourpy cycler fonttools kiwisolver pyparsing python-dateutil six)
elif [ -n "$plots" ]; then
  echo "gpu_wheels: unknown option $plots (only --plots)" >&2
  exit 2
fi
mkdir -p "$dir"
for p in "${pkgs[@]}"; do
  if ! "$py" -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
      --implementation cp --no-deps -d "$dir" "$p"; then
    echo "gpu_wheels: no wheel of $p for CPython 3.12 on PyPI: building a pure-python one" >&2
    "$py" -m pip wheel -q --no-deps -w "$dir" "$p"
    # a wheel built here must not hold compiled code (it would be for this machine's Python)
    for w in "$dir"/*.whl; do
      case "$w" in *-py3-none-any.whl|*-py2.py3-none-any.whl|*manylinux*|*-cp312-*|*-abi3-*) ;;
        *) echo "gpu_wheels: $w is not a pure-python wheel" >&2; exit 1 ;; esac
    done
  fi
done
rm -f "$dir"/*.tar.gz "$dir"/*.zip  # source archives are of no use without network
bytes=$(du -cb "$dir"/*.whl | tail -1 | cut -f1)
ls -1 "$dir"
echo "gpu_wheels: $(ls "$dir"/*.whl | wc -l) wheels, $bytes bytes ($((bytes / 1048576)) MiB) in $dir"
if [ "$bytes" -gt $((64 * 1048576)) ]; then
  echo "gpu_wheels: over 64 MiB" >&2
  exit 1
fi
