"""What of the noise backends needs a compiler, which starts processes (inductor's workers, Triton's ptxas): the
compiled CPU backend equals eager bit for bit, and the Triton kernels compiled for sm_90 without a GPU use precise
fp64 math and contract nothing. The interpreted checks are tests/unit/es/test_triton_noise.py."""
import pytest
import torch

pytest.importorskip("triton", reason="triton not installed (pip install 'esopt_mp[triton]')")

from esopt_mp.es import local_noise, triton_noise  # noqa: E402
from tests.unit.es.test_triton_noise import SEED, _info  # noqa: E402


def test_the_compiled_backend_gives_the_eager_noise():
    info = _info("uneven_cols")
    assert torch.equal(local_noise(SEED, info, backend="compile"), local_noise(SEED, info, backend="eager"))


def _ptx(name, consts, wdtype="fp32", scalar="i64"):
    """PTX of a compiled kernel for sm_90, built here without a GPU (triton ships ptxas).

    ``scalar``: the type the launch gives tid/seed (Triton passes small values as i32)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as tcompile

    geom = dict.fromkeys(["W", "base", "n0", "n1", "n2", "n3", "o0", "o1", "o2", "o3", "s0", "s1", "s2", "s3"], "i64")
    if name == "_axpy_kernel":
        sig = {"out_ptr": f"*{wdtype}", "tid_bits": scalar, "seed_bits": scalar, "scale": "fp32"}
    else:
        sig = {"w_ptr": f"*{wdtype}", "m_ptr": "*fp32", "tid_bits": scalar, "seeds_ptr": "*i64", "mw_ptr": "*fp32",
               "G": "i32", "scale": "fp32", "decay": "fp32"}
    sig.update(start="i64", n="i64", **geom)
    consts = {"QUAD": True, **consts, "BLOCK": 1024}
    src = ASTSource(fn=getattr(triton_noise._kernels(False), name), signature=sig, constexprs=consts)
    return tcompile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]


def test_compiled_kernels_use_precise_fp64_math_and_contract_nothing():
    """What can be checked of the GPU path without a GPU: the kernels compile for sm_90, the fp64
    math is libdevice's / IEEE (its log seeds with rcp.approx.f64 and refines: that is libdevice),
    and the master update's multiply-then-add is not fused."""
    eps = _ptx("_axpy_kernel", {"STORE_EPS": True})
    assert "sqrt.rn.f64" in eps and "cvt.rn.f32.f64" in eps and "__nv_log" in eps
    assert "__internal_trig_reduction_slowpathd" in eps  # libdevice's fp64 sin/cos
    assert not any(f"{op}.approx" in eps for op in ("sqrt", "sin", "cos", "lg2", "ex2"))  # no fast fp32 math
    assert "fma.rn.f32" not in eps
    fused = {m: _ptx("_update_kernel", {"MODE": m, "HAS_DECAY": True}).count("fma.rn.f32") for m in (0, 1)}
    acc_only = _ptx("_update_kernel", {"MODE": 2, "HAS_DECAY": False}).count("fma.rn.f32")  # the member sum only
    assert acc_only > 0 and fused[1] == acc_only and fused[0] == 2 * acc_only  # mode 0: + fma(w, decay, acc)
    assert "cvt.rn.bf16" not in _ptx("_axpy_kernel", {"STORE_EPS": False}, "bf16")  # integer RNE, as torch
    per_element = _ptx("_axpy_kernel", {"STORE_EPS": True, "QUAD": False})  # the unaligned path compiles too
    assert "sqrt.rn.f64" in per_element and "__nv_log" in per_element
    small = _ptx("_axpy_kernel", {"STORE_EPS": False}, scalar="i32")  # a small seed / tid arrives as i32: widened
    assert "cvt.s64.s32" in small
