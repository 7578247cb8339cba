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
