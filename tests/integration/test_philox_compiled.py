"""The compiled Philox kernel (inductor builds it with the system compiler) is bit-identical to eager."""
import torch

from esopt_mp.es.philox import get_kernel


def test_compiled_kernel_is_bit_identical_to_eager():
    q = torch.arange(0, 40_000, 3, dtype=torch.int64) + 2**32 - 100
    words = torch.tensor([7, 9, 123, 456], dtype=torch.int64)
    eager = get_kernel("eager")(q, words)
    compiled = get_kernel("compile")(q, words)
    assert torch.equal(eager, compiled)
    assert torch.equal(get_kernel("compile")(q[:17], words), eager[:17])  # other length, same graph


def test_the_compiled_kernel_is_kept_for_the_next_process(tmp_path):
    """A second process finds the first one's kernel in the on-disk cache (inductor's FX graph cache hit), and
    ``kernel_cached`` tells the noise backend's choice so; the cache dir is ``TORCHINDUCTOR_CACHE_DIR`` when set."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, torch; from torch._dynamo.utils import counters; "
            "from esopt_mp.es import philox; before = philox.kernel_cached(); "
            "philox.get_kernel('compile')(torch.arange(1000), torch.tensor([1, 2, 3, 4])); "
            "print(json.dumps({'before': before, 'after': philox.kernel_cached(), "
            "'hits': counters['inductor']['fxgraph_cache_hit'], 'dir': philox.kernel_cache_dir()}))")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "kernels"), OMP_NUM_THREADS="1")
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      timeout=600, check=True).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert runs[0]["dir"] == runs[1]["dir"] == str(tmp_path / "kernels")
    assert (runs[0]["before"], runs[0]["after"], runs[1]["before"]) == (False, True, True)
    assert runs[0]["hits"] == 0 and runs[1]["hits"] >= 1
