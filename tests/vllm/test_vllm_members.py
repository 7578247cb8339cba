"""es.member_batch on engine=vllm: each low-rank member a LoRA adapter made from its seed, a step's members in one vLLM
batch; the same greedy episodes (training and held-out: a base row plays the all-zero adapter), returns and weights as
the hf engine's batched members (fp32, decisive logits), untied at rank 1 and tied (the lm_head's own LoRA) at rank 2
(vLLM pads it to its rank 8)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["model=tiny", "model.tiny.arch=qwen3", "model.tiny.head_dim=32", "es.steps=2", "es.population=4",
        "env.episodes_per_step=2", "env.n_eval=2", "es.noise=lowrank", "es.member_batch=true",
        "es.sigma.kind=constant", "es.sigma.start=0.05", "run.export=true", "run.eval_every=1",
        "run.trajectories=true", "engine.max_new_tokens=12"]


def _run(engine: list[str], run: str, extra: list[str]):
    env = dict(os.environ, ESOPT_THREADS="2", VLLM_CPU_OMP_THREADS_BIND="0")
    proc = subprocess.run([sys.executable, "launch/train.py", *engine, *ARGS, *extra, f"run.dir={run}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(run, "history.jsonl")) as f:
        returns = [json.loads(line)["returns"] for line in f]
    with open(os.path.join(run, "trajectories.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    # the replies (the engines' prefill accounting differs: vLLM has no reuse)
    said = {(r["kind"], r.get("step"), r.get("member"), r["id"]): [t["response"] for t in r["turns"]] for r in rows}
    return returns, said, load_file(os.path.join(run, "export", "model.safetensors"))


@pytest.mark.parametrize("extra", [["es.rank=1"], ["es.rank=2", "model.tiny.tie_word_embeddings=true"]],
                         ids=["untied-rank1", "tied-rank2"])
def test_members_as_lora_adapters_play_what_the_hf_engine_plays(tmp_path, extra):
    vl, vsaid, wv = _run(["engine=vllm", "engine.kv_cache_gib=0.25"], str(tmp_path / "vllm"), extra)
    hf, hsaid, wh = _run(["engine=hf"], str(tmp_path / "hf"), extra)
    assert len(vl) == len(hf) == 2 and vl == hf
    train = [k for k in hsaid if k[0] == "train"]
    assert len(train) == 2 * 4 * 2 and len(hsaid) > len(train)  # every member's episodes, and held-out ones
    assert vsaid == hsaid  # word for word
    # the members wrote different things: each row played its own adapter (the same task and seed for a member pair)
    assert len({json.dumps(hsaid[k]) for k in train if k[1] == 0}) > 2
    assert wv.keys() == wh.keys() and all(torch.equal(wv[k], wh[k]) for k in wv)
