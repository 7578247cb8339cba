"""es.member_batch on engine=vllm: each low-rank member a LoRA adapter made from its seed, a step's members in one vLLM
batch; the same greedy episodes, returns and weights as the hf engine's batched members (fp32, decisive logits)."""
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["model=tiny", "model.tiny.arch=qwen3", "model.tiny.head_dim=32", "es.steps=2", "es.population=4",
        "env.episodes_per_step=2", "env.n_eval=2", "es.noise=lowrank", "es.rank=1", "es.member_batch=true",
        "es.sigma.kind=constant", "es.sigma.start=0.05", "run.export=true", "run.eval_every=0",
        "run.trajectories=true", "engine.max_new_tokens=12"]


def _run(engine: list[str], run: str):
    env = dict(os.environ, ESOPT_THREADS="2", VLLM_CPU_OMP_THREADS_BIND="0")
    proc = subprocess.run([sys.executable, "launch/train.py", *engine, *ARGS, f"run.dir={run}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(run, "history.jsonl")) as f:
        returns = [json.loads(line)["returns"] for line in f]
    with open(os.path.join(run, "trajectories.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    said = {(r["step"], r["member"], r["id"]): [t["response"] for t in r["turns"]] for r in rows
            if r.get("kind") == "train"}  # the replies (the engines' prefill accounting differs: vLLM has no reuse)
    return returns, said, load_file(os.path.join(run, "export", "model.safetensors"))


def test_members_as_lora_adapters_play_what_the_hf_engine_plays(tmp_path):
    vl, vsaid, wv = _run(["engine=vllm", "engine.kv_cache_gib=0.25"], str(tmp_path / "vllm"))
    hf, hsaid, wh = _run(["engine=hf"], str(tmp_path / "hf"))
    assert len(vl) == len(hf) == 2 and vl == hf
    assert len(hsaid) == 2 * 4 * 2 and vsaid == hsaid  # every member's every episode, word for word
    # the members wrote different things: each row played its own adapter (the same task and seed for a member pair)
    assert len({json.dumps(hsaid[k]) for k in hsaid if k[0] == 0}) > 2
    assert wv.keys() == wh.keys() and all(torch.equal(wv[k], wh[k]) for k in wv)
