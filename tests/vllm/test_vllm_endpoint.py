"""`objective=harness` on `engine=vllm`: each member served from the vLLM engine inside this process's worker group
(no second server), a scripted 3-turn harness with a tool call playing against it through the endpoint."""
import json
import os
import subprocess
import sys

import pytest

from esopt_mp.parallel.local_world import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["engine=vllm", "model=tiny", "model.tiny.arch=qwen3", "model.tiny.head_dim=32", "engine.kv_cache_gib=0.25",
        "objective=harness", "objective.callable=scripted_harness:play", "es.population=2", "es.steps=2",
        "env.episodes_per_step=2", "env.n_eval=2", "engine.max_new_tokens=8", "run.eval_every=0"]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_scripted_harness_trains_against_the_vllm_engine(tmp_path, tp):
    """tp=2 (torchrun): vLLM's two tp ranks are this run's; the leader serves, its peer joins each forward."""
    run = tmp_path / "run"
    env = dict(os.environ, ESOPT_THREADS=str(2 // tp), VLLM_CPU_OMP_THREADS_BIND="0|1" if tp == 2 else "0",
               PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "examples"), ROOT]))
    head = [sys.executable] if tp == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                                       f"--master_port={free_port()}"]
    proc = subprocess.run([*head, "launch/train.py", *ARGS, f"parallel.tp={tp}", f"run.dir={run}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "vllm engine up" in proc.stderr  # the member was vLLM's, not the hf engine's
    summary = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["steps"] == 2
    ledger = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert len(ledger) == 2 and all(row["failures"] == {"model": 0, "wall_clock": 0, "infra": 0} for row in ledger)
    assert all(r is not None and 0.0 <= r <= 1.0 for row in ledger for r in row["returns"])
    rows = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert sorted((r["step"], r["member"]) for r in train) == sorted([(t, m) for t in (0, 1) for m in range(2)] * 2)
    for r in train:  # recorded from the endpoint's side: 3 requests, the worked tool call, the member's replies
        assert r["ended"] == "returned" and r["failure"] is None and len(r["requests"]) == 3
        assert r["requests"][0]["tools"][0]["function"]["name"] == "calculator"
        assert all(q["reply"]["role"] == "assistant" and q["usage"]["completion_tokens"] >= 1 for q in r["requests"])
