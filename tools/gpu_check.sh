#!/usr/bin/env bash
# The GPU checks as one script for a GPU machine, which may have no network: under 8 minutes on one H100/H200,
# one JSON line on stdout (the last line, always printed), each part's result or its exit status and error tail.
#
#   bash tools/gpu_check.sh [--wheels DIR]      # or ESOPT_WHEELS=DIR; DIR made by tools/gpu_wheels.sh
#
# Parts, in this order, each under its own time limit cut to what is left of the budget:
#   setup        from DIR, what does not import here in a usable version (hydra-core, omegaconf, antlr4...), into
#                WORK/site, put first on PYTHONPATH (no root, no network: tools/gpu_wheels_install.py); without
#                DIR it only says what is missing. esopt_mp runs from this checkout (PYTHONPATH), not installed.
#   env          Python, platform, torch / CUDA / transformers / Triton / vLLM versions, driver and GPU
#   noise_check  the Triton noise kernels' bit-equality with the torch path on this GPU (bench_noise.py --cuda)
#   eager        tools/gpu_check.py on the Qwen3.5-4B shape with random bf16 weights: the hf engine's tokens/s, ES
#                overhead per step, device peak of an ES step over inference (torch's allocator, and NVML); then
#                vLLM's, and its perturbed runtime tensors vs the hf engine's, if vllm imports
#   pinned       tests/gpu/test_pinned.py: the pinned host snapshot / fp32 master take exactly the shards' bytes
#   graphs       the vLLM run again with CUDA graphs (do captured graphs see in-place edits?); needs vLLM
#   members      tools/bench_members.py on the eager part's checkpoint: a low-rank ES step with all members in one batch vs batch
#                inference and full-rank members in turn (tokens/s, device peak), G = 8 and 16
#   noise        the Triton kernels' speed: noise elements/s, the fused update's bytes/s vs a device copy
# Without vLLM, everything but vLLM's own figures is measured and eager.vllm reads {"available": false, ...}.
#
# Environment: ESOPT_GPU_CHECK_DIR (WORK, default /tmp/esopt_gpu_check: each part's output, the random checkpoint
# kept for a rerun), ESOPT_GPU_CHECK_ARGS (more arguments for tools/gpu_check.py, e.g. "--shape tiny --batch 2"
# for a dry run on a CPU), ESOPT_GPU_CHECK_MEMBERS_ARGS (tools/bench_members.py's sizes, default
# "--dtype bfloat16 --G 8 16 --episodes 4 --tokens 32"), ESOPT_GPU_CHECK_BUDGET_S (seconds for all parts, default 460), PYTHON (default python3).
set -uo pipefail
wheels="${ESOPT_WHEELS:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) [ $# -ge 2 ] || { echo "gpu_check: --wheels takes a folder" >&2; exit 2; }; wheels="$2"; shift 2 ;;
    --wheels=*) wheels="${1#--wheels=}"; shift ;;
    *) echo "usage: bash tools/gpu_check.sh [--wheels DIR]" >&2; exit 2 ;;
  esac
done
py="${PYTHON:-$(command -v python3 || command -v python)}"
dir="${ESOPT_GPU_CHECK_DIR:-/tmp/esopt_gpu_check}"
budget="${ESOPT_GPU_CHECK_BUDGET_S:-460}"  # parts' limits; each may overrun by timeout's 10 s grace: under 8 min
args="${ESOPT_GPU_CHECK_ARGS:-}"
margs="${ESOPT_GPU_CHECK_MEMBERS_ARGS:---dtype bfloat16 --G 8 16 --episodes 4 --tokens 32}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"  # folders given relative to where the script was started from
[ -d "$wheels" ] && wheels="$(cd "$wheels" && pwd)"
cd "$(dirname "$0")/.."
rm -f "$dir"/*.out "$dir"/*.err "$dir"/*.rc "$dir"/*.xml  # an earlier run's results are not this run's
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # esopt_mp and tools/ from this checkout

skip() {  # NAME REASON: the part is reported as skipped, with why
  "$py" -c 'import json, sys; print(json.dumps({"skipped": True, "reason": sys.argv[1]}))' "$2" > "$dir/$1.out"
  echo 0 > "$dir/$1.rc"
}
part() {  # NAME CAP CMD...: CMD under min(CAP, what is left of the budget); stdout, stderr, exit status kept
  local name=$1 cap=$2 left=$((budget - SECONDS))
  shift 2
  [ "$left" -gt "$cap" ] && left=$cap
  if [ "$left" -lt 20 ]; then
    skip "$name" "only $((budget - SECONDS)) s left of the ${budget} s budget"
    return
  fi
  timeout -k 10 "$left" "$@" > "$dir/$name.out" 2> "$dir/$name.err"
  echo $? > "$dir/$name.rc"
}

if [ -n "$wheels" ] && [ ! -d "$wheels" ]; then
  skip setup "no wheel folder at $wheels"
else
  export PYTHONPATH="$dir/site:$PYTHONPATH"  # first: it shadows a site-packages version that does not do
  part setup 240 "$py" tools/gpu_wheels_install.py "${wheels:--}" "$dir/site"
fi
part env 60 "$py" - <<'PY'
import json

import torch

from esopt_mp.profiling.versions import library_versions

v = library_versions()
v["cuda_available"] = torch.cuda.is_available()
v["device"] = torch.cuda.get_device_name() if v["cuda_available"] else None
print(json.dumps(v))
PY
# the Triton kernels' bit-equality with torch on this GPU first (its verdict must not be lost to a timeout)
part noise_check 60 env -u TRITON_INTERPRET "$py" tools/bench_noise.py --cuda --check-only
# shellcheck disable=SC2086  # $args: more arguments, split on spaces
part eager 270 "$py" tools/gpu_check.py --dir "$dir" $args
part pinned 90 "$py" -m pytest -q -p no:cacheprovider tests/gpu/test_pinned.py --junitxml="$dir/pinned.xml"
vllm=$("$py" - "$dir/eager.out" <<'PY'
import json
import sys

try:
    v = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]).get("vllm") or {}
except Exception:  # noqa: BLE001
    v = {"reason": "the eager part gave no result"}
if v.get("available") and "error" not in v:
    print("yes")
elif v.get("available"):  # it imported, and its eager run failed: the graphs run would fail the same way
    print(f"its eager run failed: {v['error']}")
else:
    print(v.get("reason") or "the eager part gave no verdict on it")
PY
)
if [ "$vllm" = yes ]; then
  # shellcheck disable=SC2086
  part graphs 110 "$py" tools/gpu_check.py --dir "$dir" --graphs --members 2 $args
else
  skip graphs "vLLM not available: $vllm"
fi
# members in one batch (es.noise=lowrank) vs batch inference and full-rank members in turn, on the random checkpoint
ckpt=$(dirname "$(ls -d "$dir"/*/config.json 2>/dev/null | head -1)")
if [ -f "$ckpt/config.json" ]; then
  # shellcheck disable=SC2086  # $margs: arguments, split on spaces
  part members 100 "$py" tools/bench_members.py --model "$ckpt" --modes inference lowrank_batch fullrank_seq $margs
else
  skip members "no random checkpoint in $dir (the eager part writes it)"
fi
part noise 120 env -u TRITON_INTERPRET "$py" tools/bench_noise.py --cuda  # what is left of the budget

"$py" - "$dir" "$SECONDS" "$budget" <<'PY' || echo "{\"error\": \"the report could not be written; see $dir\"}"
import json
import os
import sys
import xml.etree.ElementTree as ET

d, seconds, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


def read(name: str, ext: str) -> str:
    try:
        with open(os.path.join(d, f"{name}.{ext}"), errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def status(name: str) -> int | None:
    rc = read(name, "rc").strip()
    return int(rc) if rc.lstrip("-").isdigit() else None


def load(name: str) -> dict:
    """The part's last stdout line as JSON; with a failure, its exit status and the tail of its stderr."""
    rc, lines = status(name), read(name, "out").strip().splitlines()
    try:
        res = json.loads(lines[-1])
        if isinstance(res, dict) and "benchmark" in res and "figures" in res:  # a benchmark's record: its figures
            res = res["figures"]
        if not isinstance(res, dict):
            res = {"result": res}
    except (IndexError, ValueError):
        res = {"stdout_tail": "\n".join(lines)[-600:]} if lines else {}
        rc = 1 if rc == 0 else rc  # no result is a failure whatever the status
    if rc != 0:
        res.update({"exit": rc, "timed_out": rc in (124, 137), "error_tail": read(name, "err")[-1500:]})
    return res


def pinned() -> dict:
    """pytest's outcome from its JUnit XML: counts, and each failed or skipped test with its message."""
    rc = status("pinned")
    if read("pinned", "out").startswith("{"):  # skipped for want of time
        return load("pinned")
    res = {} if rc == 0 else {"exit": rc, "timed_out": rc in (124, 137),
                              "error_tail": (read("pinned", "out") + read("pinned", "err"))[-1500:]}
    try:
        root = ET.parse(os.path.join(d, "pinned.xml")).getroot()
    except (OSError, ET.ParseError):
        res["error"] = "no JUnit XML from pytest"
        return res
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    res.update(n, passed=n["tests"] - n["failures"] - n["errors"] - n["skipped"], cases={})
    for case in suite.iter("testcase"):
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                res["cases"][case.get("name")] = {kind: (el.get("message") or el.text or "")[:300]}
    if n["failures"] + n["errors"]:
        res.pop("error_tail", None)  # the failed cases say more than the log's tail
    res["ok"] = n["failures"] + n["errors"] == 0 and res.get("exit") is None
    return res


report = {name: load(name) for name in ("env", "setup", "noise_check", "eager")}
report["pinned"] = pinned()
report.update({name: load(name) for name in ("graphs", "members", "noise")})
report.update(seconds=seconds, budget_s=budget, dir=d)
print(json.dumps(report))
PY
