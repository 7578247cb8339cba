"""`deepspeed launch/train.py algo=grpo algo.zero_stage=N`: the GRPO baseline under DeepSpeed ZeRO on 2 GPUs."""
import json
import subprocess
import sys

import pytest
import torch

from esopt_mp.parallel.local_world import free_port
from tests.integration.test_baselines_launch import ROOT, SHORT

pytestmark = [pytest.mark.process, pytest.mark.slow]  # it starts processes (gpu: the folder's)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_stages(tmp_path, stage):
    """`deepspeed launch/train.py algo=grpo algo.zero_stage=N` on 2 GPUs (on this 2-core CPU machine the
    DS_ACCELERATOR=cpu run built its shm op, then made no progress within 400 s: GPU-only)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           "launch/train.py", "parallel.launcher=deepspeed", "parallel.dp=2", "algo=grpo", f"algo.zero_stage={stage}",
           "model.dtype=bfloat16", *SHORT, f"run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r] == [0, 1] and "summary" in rows[-1]
    assert (tmp_path / "run" / "baseline" / "rank1.pt").exists()
