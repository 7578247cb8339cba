"""The noise spec (ARCHITECTURE.md s.4) as Triton kernels fused with the ES weight operations.

Each program takes BLOCK consecutive elements of a local shard, turns each local flat index into
its row-major index ``j`` in the canonical (unsharded) tensor from the ShardInfo geometry (run
width, outer local sizes, global offsets and strides: whole tensors, row / column / any box), and
computes eps(j) exactly as :func:`esopt_mp.es.philox.normals_kernel` does: ``tl.philox`` (the
same Philox4x32-10 rounds) keyed by the member seed on counter ``(j//4, tid)``, the output word
pair of lane ``j % 4``, Box-Muller in float64, one float32 rounding. The fp64 constant
2*pi*2**-32 is built from its bit pattern: a Python float literal in a Triton expression is an
fp32 constant.

Arithmetic mirrors the torch ops of :class:`esopt_mp.es.perturber.Perturber` one for one, so
results are bit-identical wherever eps is: ``w.add_(z, alpha=a)`` is one fused multiply-add in
fp32 (checked on CPU and in torch's CUDA add), so the kernels call ``tl.fma`` there and launch
with ``enable_fp_fusion=False`` so that no other multiply and add is contracted (the master
update is a multiply then an add in torch). bf16/fp16 weights are read exactly into fp32,
computed in fp32 and rounded to nearest-even once on the store, as torch's mixed-dtype in-place
ops do.

Without CUDA, ``TRITON_INTERPRET=1`` runs these kernels on CPU tensors (numpy); that is how the
tests check them. The interpreter's float64 log/sin/cos/sqrt are numpy's, torch's CPU ones are
SLEEF's: they differ by one fp64 ulp on ~0.1% of inputs (sqrt on ~1%), which changes a float32
normal only when it lies within an ulp of a float32 rounding boundary (see README, "Noise").
"""
from __future__ import annotations

import os
import struct

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # optional extra: pip install esopt_mp[triton]
    triton = None

MAX_OUTER = 4  # outer (non-run) dims of a sliced shard the kernels index; 5-d tensors and below
BLOCK = 1024


def available() -> bool:
    return triton is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(device) -> None:
    """Raise the error a user of ``es.noise_backend=triton`` needs when the kernels cannot run here."""
    if triton is None:
        raise RuntimeError("es.noise_backend=triton needs the triton package (pip install 'esopt_mp[triton]'); "
                           "use es.noise_backend=auto to pick an available backend")
    device = torch.device(device)
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(f"es.noise_backend=triton runs on CUDA tensors (these are on {device}); on CPU only "
                           "under TRITON_INTERPRET=1 (slow, for tests); use es.noise_backend=auto")


def _i64(v: int) -> int:
    """A uint64 as the int64 with the same bits (the kernels bitcast it back)."""
    v = int(v)
    return v - (1 << 64) if v >= 1 << 63 else v


def _f32(v: float) -> float:
    """The float32 torch would round a Python scalar to, so the launch passes it exactly."""
    return struct.unpack("f", struct.pack("f", float(v)))[0]


def _geometry(info) -> tuple:
    """(W, base, outer sizes, outer global offsets, outer global strides), outer padded to MAX_OUTER."""
    width, outer, olo, ostride, base = info._runs
    if len(outer) > MAX_OUTER:
        raise ValueError(f"{info.name}: the triton noise kernels index shards of at most {MAX_OUTER + 1} dims "
                         f"sliced below the first; got {len(info.global_shape)} dims")
    pad = MAX_OUTER - len(outer)
    return (width, base, *((1,) * pad + tuple(outer)), *((0,) * pad + tuple(olo)),
            *((0,) * pad + tuple(ostride)))


if triton is not None:
    _TWO_PI_2_32_BITS = tl.constexpr(struct.unpack("<q", struct.pack("<d", 2.0 * 3.141592653589793 * 2.0**-32))[0])
    _GEOM = ["W", "base", "n0", "n1", "n2", "n3", "o0", "o1", "o2", "o3", "s0", "s1", "s2", "s3"]
    _NO_SPEC = ["start", "n", "G"] + _GEOM

    @triton.jit
    def _global_index(i, W, base, n0, n1, n2, n3, o0, o1, o2, o3, s0, s1, s2, s3):
        """Row-major index in the canonical tensor of local flat index ``i`` (int64)."""
        r = i // W
        j = base + i % W
        j += (r % n3 + o3) * s3
        r = r // n3
        j += (r % n2 + o2) * s2
        r = r // n2
        j += (r % n1 + o1) * s1
        r = r // n1
        j += (r % n0 + o0) * s0
        return j

    @triton.jit
    def _normal(j, seed, tid):
        """eps at canonical indices ``j`` (int64 block) for member ``seed``, tensor ``tid`` (uint64 scalars)."""
        q = j // 4
        lane = j % 4
        c0 = (q & 0xFFFFFFFF).to(tl.uint32)
        c1 = (q >> 32).to(tl.uint32)
        c2 = tl.zeros_like(c0) + (tid & 0xFFFFFFFF).to(tl.uint32)
        c3 = tl.zeros_like(c0) + (tid >> 32).to(tl.uint32)
        x0, x1, x2, x3 = tl.philox(seed, c0, c1, c2, c3, 10)
        xa = tl.where(lane < 2, x0, x2)
        xb = tl.where(lane < 2, x1, x3)
        u1 = (xa.to(tl.float64) + 1.0) * 2.3283064365386963e-10  # 2**-32, exact in fp32
        two_pi_2_32 = tl.full([], _TWO_PI_2_32_BITS, tl.int64).to(tl.float64, bitcast=True)
        t = xb.to(tl.float64) * two_pi_2_32
        r = tl.sqrt(-2.0 * tl.log(u1))
        z = tl.where(lane % 2 == 0, r * tl.cos(t), r * tl.sin(t))
        return z.to(tl.float32)

    @triton.jit
    def _to_bf16_rne(x):
        """fp32 -> bf16 rounded to nearest-even, NaN -> 0x7FC0: torch's c10::BFloat16 rule, in integer
        ops because Triton's interpreter truncates fp32 -> bf16 (its compiled cast rounds)."""
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _store(ptr, x, mask):
        """Store fp32 ``x`` into ``ptr``'s dtype, rounded once to nearest-even (as torch's copy_/add_)."""
        if ptr.dtype.element_ty == tl.float32:
            tl.store(ptr, x, mask=mask)
        elif ptr.dtype.element_ty == tl.bfloat16:
            tl.store(ptr, _to_bf16_rne(x), mask=mask)
        else:
            tl.store(ptr, x.to(ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

    @triton.jit(do_not_specialize=_NO_SPEC)
    def _axpy_kernel(out_ptr, keys_ptr, scale, start, n,
                     W, base, n0, n1, n2, n3, o0, o1, o2, o3, s0, s1, s2, s3,
                     STORE_EPS: tl.constexpr, BLOCK: tl.constexpr):
        """out[k] = eps (STORE_EPS) or fma(eps, scale, out[k]) for local elements start + k, k < n."""
        k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = k < n
        j = _global_index(start + k, W, base, n0, n1, n2, n3, o0, o1, o2, o3, s0, s1, s2, s3)
        tid = tl.load(keys_ptr).to(tl.uint64, bitcast=True)
        seed = tl.load(keys_ptr + 1).to(tl.uint64, bitcast=True)
        z = _normal(j, seed, tid)
        if STORE_EPS:
            _store(out_ptr + k, z, mask)
        else:
            w = tl.load(out_ptr + k, mask=mask).to(tl.float32)
            _store(out_ptr + k, tl.fma(z, scale, w), mask)

    @triton.jit(do_not_specialize=_NO_SPEC)
    def _update_kernel(w_ptr, m_ptr, keys_ptr, mw_ptr, G, scale, decay, start, n,
                       W, base, n0, n1, n2, n3, o0, o1, o2, o3, s0, s1, s2, s3,
                       MODE: tl.constexpr, HAS_DECAY: tl.constexpr, BLOCK: tl.constexpr):
        """acc = scale * sum_g fma-accumulated mw[g] * eps(seed g), in registers; then by MODE:
        0: w = fma(w, decay, acc) (or w + acc); 1: m = m * decay + acc, w = m; 2: w = acc (an fp32 buffer)."""
        k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = k < n
        j = _global_index(start + k, W, base, n0, n1, n2, n3, o0, o1, o2, o3, s0, s1, s2, s3)
        tid = tl.load(keys_ptr).to(tl.uint64, bitcast=True)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for g in range(0, G):
            seed = tl.load(keys_ptr + 1 + g).to(tl.uint64, bitcast=True)
            acc = tl.fma(_normal(j, seed, tid), tl.load(mw_ptr + g), acc)
        acc = acc * scale
        if MODE == 0:
            w = tl.load(w_ptr + k, mask=mask).to(tl.float32)
            if HAS_DECAY:
                w = tl.fma(w, decay, acc)
            else:
                w = w + acc
            _store(w_ptr + k, w, mask)
        elif MODE == 1:
            m = tl.load(m_ptr + k, mask=mask)
            if HAS_DECAY:
                m = m * decay
            m = m + acc
            tl.store(m_ptr + k, m, mask=mask)
            _store(w_ptr + k, m, mask)
        else:
            tl.store(w_ptr + k, acc, mask=mask)


def _launch(kernel, flat: torch.Tensor, start: int, n: int, info, *args, **consts) -> None:
    check_device(flat.device)
    if n <= 0:
        return
    grid = (triton.cdiv(n, BLOCK),)
    kernel[grid](*args, start, n, *_geometry(info), BLOCK=BLOCK, enable_fp_fusion=False, **consts)


def _keys(tid: int, seeds, device) -> torch.Tensor:
    return torch.tensor([_i64(tid)] + [_i64(s) for s in seeds], dtype=torch.int64, device=device)


def axpy_(out: torch.Tensor, seed: int, info, scale: float | None, start: int = 0) -> torch.Tensor:
    """``out`` (a contiguous 1-d view of local elements start..start+len) += scale * eps, or = eps
    when ``scale`` is None. Returns ``out``."""
    keys = _keys(info.tid, [seed], out.device)
    _launch(_axpy_kernel, out, start, out.numel(), info, out, keys, _f32(scale or 0.0), STORE_EPS=scale is None)
    return out


def update_(w: torch.Tensor, info, members, scale: float, decay: float, *, master: torch.Tensor | None = None,
            start: int = 0, acc_only: bool = False) -> None:
    """One pass over local elements start..start+len(w) for all ``members`` [(seed, weight)].

    ``w`` gets decay * w + scale * sum_g weight_g * eps_g (rounded once), or, with ``master`` on
    the same device, the master gets it and ``w`` its rounding; ``acc_only``: ``w`` (fp32) gets
    just scale * sum. The fp32 sum lives in registers: no accumulator in memory.
    """
    mode = 2 if acc_only else (1 if master is not None else 0)
    if acc_only and w.dtype != torch.float32:
        raise ValueError("acc_only needs an fp32 output buffer")
    keys = _keys(info.tid, [s for s, _ in members], w.device)
    mw = torch.tensor([_f32(x) for _, x in members] or [0.0], dtype=torch.float32, device=w.device)
    m = master if master is not None else w
    _launch(_update_kernel, w, start, w.numel(), info, w, m, keys, mw, len(members), _f32(scale), _f32(decay),
            MODE=mode, HAS_DECAY=decay != 1.0)
