#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (under 8 minutes on one H100/H200):
#   hf vs vllm on the Qwen3.5-4B shape with random bf16 weights (tokens/s, ES overhead per step, device peak of
#   an ES step over inference, vLLM's perturbed runtime tensors vs the hf engine's), then the same vLLM run
#   with CUDA graphs (are in-place edits seen by captured graphs?), then the Triton noise kernels
#   (tools/bench_noise.py --cuda: bit-equality with the torch path on the GPU, noise elements/s, fused
#   update bytes/s vs a device-to-device copy). Prints one JSON line.
# Needs a CUDA torch and vllm already installed (the device machine has no network).
set -uo pipefail
cd "$(dirname "$0")/.."
dir="${ESOPT_GPU_CHECK_DIR:-/tmp/esopt_gpu_check}"
mkdir -p "$dir"
python - <<'PY' > "$dir/env.json"
import json, torch
try:
    import vllm; v = vllm.__version__
except Exception as e:
    v = f"not importable: {type(e).__name__}: {e}"
print(json.dumps({"torch": torch.__version__, "cuda": torch.cuda.is_available(),
                  "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "vllm": v}))
PY
# the Triton kernels' bit-equality with torch on this GPU first (its verdict must not be lost to a timeout)
env -u TRITON_INTERPRET timeout 60 python tools/bench_noise.py --cuda --check-only > "$dir/noise_check.json" \
  2> "$dir/noise_check.err"; e0=$?
timeout 270 python tools/gpu_check.py --dir "$dir" > "$dir/eager.json" 2> "$dir/eager.err"; e1=$?
timeout 110 python tools/gpu_check.py --dir "$dir" --graphs --members 2 > "$dir/graphs.json" 2> "$dir/graphs.err"; e2=$?
left=$((470 - SECONDS)); [ "$left" -gt 120 ] && left=120   # the noise bench takes what is left of 8 minutes
if [ "$left" -ge 30 ]; then
  env -u TRITON_INTERPRET timeout "$left" python tools/bench_noise.py --cuda > "$dir/noise.json" 2> "$dir/noise.err"; e3=$?
else
  echo "{\"skipped\": true, \"reason\": \"only ${left}s left of the 8-minute budget\"}" > "$dir/noise.json"; e3=0
fi
python - "$dir" "$e0" "$e1" "$e2" "$e3" <<'PY'
import json, os, sys
d, e0, e1, e2, e3 = sys.argv[1], *map(int, sys.argv[2:6])
def load(name, rc):
    p = os.path.join(d, name + ".json")
    try:
        return json.loads(open(p).read().strip().splitlines()[-1])
    except Exception:
        err = open(os.path.join(d, name + ".err")).read()[-600:] if os.path.exists(os.path.join(d, name + ".err")) else ""
        return {"exit": rc, "error_tail": err}
print(json.dumps({"env": json.load(open(os.path.join(d, "env.json"))), "eager": load("eager", e1),
                  "graphs": load("graphs", e2), "noise_check": load("noise_check", e0), "noise": load("noise", e3)}))
PY
