"""The compiled Triton noise kernels against the eager torch path on a GPU (a fresh process: no interpreter mode)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton not installed (pip install 'esopt_mp[triton]')")

from tests.unit.es.test_triton_noise import ROOT  # noqa: E402

pytestmark = [pytest.mark.process, pytest.mark.slow]  # it starts a process (gpu: the folder's)


def test_cuda_kernels_equal_torch_reference_on_cuda():
    """Compiled kernels (a fresh process: no interpreter) vs the eager torch path on the same GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_noise.py"), "--cuda", "--check-only"],
                         capture_output=True, text=True, env=env, timeout=600, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])["figures"]
    if res.get("skipped"):
        pytest.skip(res["reason"])
    assert res["equal"] and all(res["equal"].values()), res
