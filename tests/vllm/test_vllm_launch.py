"""`python launch/train.py engine=vllm` end to end on CPU; the ledger replays (hf, esopt replay) into its export."""
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from esopt_mp.parallel.local_world import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["engine=vllm", "model=tiny", "model.tiny.arch=qwen3", "model.tiny.head_dim=32", "es.steps=2",
        "es.population=4", "es.weight_decay=0.05", "env.episodes_per_step=2", "env.n_eval=2", "engine.kv_cache_gib=0.25",
        "run.checkpoint_every=1", "run.export=true"]


def _tensors(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


# dp=2 is not launched here: its vLLM side (one engine per dp group, no lockstep, replicas equal after an update)
# is test_vllm_engine's dp test, the trainer's dp replica check is engine-agnostic (tests/integration/test_launch)
@pytest.mark.parametrize("dp,tp", [(1, 1), (1, 2)])
def test_engine_vllm_run_exports_what_the_ledger_replays(tmp_path, dp, tp):
    """One vLLM engine, its tp ranks inside it (torchrun for 2 ranks)."""
    run = str(tmp_path / "run")
    world = dp * tp
    env = dict(os.environ, ESOPT_THREADS=str(2 // world), VLLM_CPU_OMP_THREADS_BIND="0|1" if world == 2 else "0")
    launcher = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                     f"--nproc_per_node={world}", f"--master_port={free_port()}"]
    proc = subprocess.run([*launcher, "launch/train.py", *ARGS, f"parallel.dp={dp}", f"parallel.tp={tp}",
                           "parallel.checksum_every=1", f"run.dir={run}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert '"steps": 2' in proc.stdout
    export = _tensors(os.path.join(run, "export"))
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in export)  # HF layout, never vLLM's fused names
    rep = subprocess.run([sys.executable, "-m", "esopt_mp.commands", "replay", "--run-dir", run, "--out", str(tmp_path / "replayed")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert rep.returncode == 0, rep.stderr[-3000:]
    replayed = _tensors(str(tmp_path / "replayed"))
    base = _tensors(os.path.join(run, "base_model"))
    assert set(replayed) == set(export) == set(base)
    for k in export:
        assert torch.equal(export[k], replayed[k]), k
    assert any(not torch.equal(export[k], base[k]) for k in export)  # two steps (weight decay at least) moved it
    if world > 1:
        return
    # resume through the vLLM workers: lose the final checkpoint, rerun the same command -> the step-1 checkpoint
    # loads into the workers' pieces, the ledger's step 2 replays as an update rpc, the export is rebuilt from them
    shutil.rmtree(os.path.join(run, "ckpt", "step_000002"))
    shutil.rmtree(os.path.join(run, "export"))
    again = subprocess.run([*launcher, "launch/train.py", *ARGS, f"run.dir={run}"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    assert '"resumed_from": 2' in again.stdout and "replayed 1 ledger entries" in again.stderr
    export = _tensors(os.path.join(run, "export"))
    for k in export:
        assert torch.equal(export[k], replayed[k]), k
