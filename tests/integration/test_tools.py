"""Benchmark scripts stay runnable and print the figures they promise."""
import json
import math
import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _json(script, *args):
    proc = subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, BENCH_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(proc.stdout.strip().splitlines()[-1])  # every benchmark's one record: its figures inside
    assert set(rec) == {"benchmark", "command", "machine", "versions", "figures"}
    assert rec["command"] == " ".join(["python", script, *args]), rec["command"]
    return rec["figures"]


def test_bench_noise_quick():
    r = _json("tools/bench_noise.py", "--quick")
    assert r["throughput"]["compiled_elems_per_s"] > 0 and r["throughput"]["randn_elems_per_s"] > 0
    assert set(r["update"]) == {"G8", "G32"}
    mem = r["memory"]
    assert set(mem) >= {"subtract", "snapshot", "snapshot+fp32_host"}
    # RSS figures (the state each mode keeps, ~1x shard or nothing) are the benchmark's to report, not a pass/fail
    # test on a busy machine: here only that each is reported, as a finite number
    for m in ("subtract", "snapshot", "snapshot+fp32_host"):
        ops = [v for v in mem[m].values() if isinstance(v, dict) and "retained_over_shard" in v]
        assert ops and all(math.isfinite(v["retained_over_shard"]) for v in ops), mem[m]
    assert all("extra_bytes" in mem[m][op] for m in ("subtract", "snapshot") for op in ("perturb", "update"))
    assert r["drift_bf16"]["snapshot"]["max_ulp"] == 0 and r["drift_bf16"]["subtract"]["max_ulp"] > 0
    assert abs(r["drift_bf16"]["moved_fraction_fp32_host"] - 1) < 0.01


def test_bench_rollout():
    r = _json("tools/bench_rollout.py", "--episodes", "8", "--turns", "3")
    assert r["same_games"] == {"engine_reencode": True, "batched_generate": True, "generate_loop": True}
    assert r["engine_reuse"]["prefill_tokens"] < r["engine_reencode"]["prefill_tokens"]
    gen = {k: r[k]["generated_tokens"] for k in ("engine_reuse", "batched_generate", "generate_loop")}
    assert len(set(gen.values())) == 1, gen
    assert r["engine_reuse"]["cap_fraction"] < 1  # the shipped agent stops on <|im_end|>, not at the cap
    assert r["batched_generate"]["padded_prefill_tokens"] >= r["batched_generate"]["prefill_tokens"]
