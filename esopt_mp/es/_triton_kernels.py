"""The @triton.jit kernels of :mod:`esopt_mp.es.triton_noise` (see its docstring for the spec and rounding).

Loaded by :func:`esopt_mp.es.triton_noise._kernels` once per mode, compiled (CUDA) or interpreted
(CPU tensors, TRITON_INTERPRET=1): Triton binds a kernel to its mode when it is decorated, so each
mode gets its own copy of this module and one process can hold both.
"""
import struct

import triton
import triton.language as tl

_TWO_PI_2_32_BITS = tl.constexpr(struct.unpack("<q", struct.pack("<d", 2.0 * 3.141592653589793 * 2.0**-32))[0])
_GEOM = ["W", "base", "n0", "n1", "n2", "n3", "o0", "o1", "o2", "o3", "s0", "s1", "s2", "s3"]
_NO_SPEC = ["start", "n", "G", "tid_bits", "seed_bits"] + _GEOM


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
def _philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 words, as philox.philox_rounds (and tl.philox, whose library
    function is bound to one mode at triton's import, so it is not called here)."""
    for _ in tl.static_range(10):
        p0c, p2c = c0, c2
        c0 = tl.umulhi(p2c, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(p0c, 0xD2511F53) ^ c3 ^ k1
        c1 = p2c * 0xCD9E8D57
        c3 = p0c * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _words(q, seed, tid):
    """Philox words for counters ``q`` (int64) keyed by ``seed`` on tensor ``tid`` (uint64 scalars)."""
    c0 = (q & 0xFFFFFFFF).to(tl.uint32)
    c1 = (q >> 32).to(tl.uint32)
    c2 = tl.broadcast_to((tid & 0xFFFFFFFF).to(tl.uint32), c0.shape)
    c3 = tl.broadcast_to((tid >> 32).to(tl.uint32), c0.shape)
    return _philox(c0, c1, c2, c3, (seed & 0xFFFFFFFF).to(tl.uint32), (seed >> 32).to(tl.uint32))


@triton.jit
def _radius_angle(xa, xb):
    """float64 r = sqrt(-2 ln u1), t = 2 pi u2 for the word pair (xa, xb), as philox.normals_kernel."""
    u1 = (xa.to(tl.float64) + 1.0) * 2.3283064365386963e-10  # 2**-32, exact in fp32
    two_pi_2_32 = tl.full([], _TWO_PI_2_32_BITS, tl.int64).to(tl.float64, bitcast=True)
    return tl.sqrt(-2.0 * tl.log(u1)), xb.to(tl.float64) * two_pi_2_32


@triton.jit
def _normal(j, seed, tid):
    """eps at canonical indices ``j`` (any int64 block): one counter per element, its lane's output."""
    lane = j % 4
    x0, x1, x2, x3 = _words(j // 4, seed, tid)
    r, t = _radius_angle(tl.where(lane < 2, x0, x2), tl.where(lane < 2, x1, x3))
    z = tl.where(lane % 2 == 0, r * tl.cos(t), r * tl.sin(t))
    return z.to(tl.float32)


@triton.jit
def _normals4(q, seed, tid):
    """eps [Q, 4] at indices 4q..4q+3: one counter and two Box-Muller pairs for four elements."""
    x0, x1, x2, x3 = _words(q, seed, tid)
    ra, ta = _radius_angle(x0, x1)
    rb, tb = _radius_angle(x2, x3)
    za, zb = (ra * tl.cos(ta)).to(tl.float32), (ra * tl.sin(ta)).to(tl.float32)
    zc, zd = (rb * tl.cos(tb)).to(tl.float32), (rb * tl.sin(tb)).to(tl.float32)
    return tl.reshape(tl.join(tl.join(za, zc), tl.join(zb, zd)), [q.shape[0], 4])


@triton.jit
def _tile(start, W, base, n0, n1, n2, n3, o0, o1, o2, o3, s0, s1, s2, s3, QUAD: tl.constexpr, BLOCK: tl.constexpr):
    """This program's local offsets ``k`` and what :func:`_eps` needs: element indices [BLOCK], or with
    QUAD (every run starts at a multiple of 4, and so does ``start``) counters [BLOCK // 4] for a
    [BLOCK // 4, 4] tile, so each counter's Philox and Box-Muller serve four elements."""
    pid = tl.program_id(0).to(tl.int64)
    if QUAD:
        kq = pid * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
        k = kq[:, None] * 4 + tl.arange(0, 4)[None, :]
        idx = _global_index(start + kq * 4, W, base, n0, n1, n2, n3, o0, o1, o2, o3, s0, s1, s2, s3) // 4
    else:
        k = pid * BLOCK + tl.arange(0, BLOCK)
        idx = _global_index(start + k, W, base, n0, n1, n2, n3, o0, o1, o2, o3, s0, s1, s2, s3)
    return k, idx


@triton.jit
def _eps(idx, seed, tid, QUAD: tl.constexpr):
    if QUAD:
        return _normals4(idx, seed, tid)
    else:
        return _normal(idx, seed, tid)


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
def _axpy_kernel(out_ptr, tid_bits, seed_bits, scale, start, n,
                 W, base, n0, n1, n2, n3, o0, o1, o2, o3, s0, s1, s2, s3,
                 STORE_EPS: tl.constexpr, QUAD: tl.constexpr, BLOCK: tl.constexpr):
    """out[k] = eps (STORE_EPS) or fma(eps, scale, out[k]) for local elements start + k, k < n."""
    k, idx = _tile(start, W, base, n0, n1, n2, n3, o0, o1, o2, o3, s0, s1, s2, s3, QUAD, BLOCK)
    mask = k < n
    tid = tid_bits.to(tl.int64).to(tl.uint64, bitcast=True)  # scalars: no host-to-device copy per launch
    seed = seed_bits.to(tl.int64).to(tl.uint64, bitcast=True)  # (a small value arrives as i32: widen first)
    z = _eps(idx, seed, tid, QUAD)
    if STORE_EPS:
        _store(out_ptr + k, z, mask)
    else:
        w = tl.load(out_ptr + k, mask=mask).to(tl.float32)
        _store(out_ptr + k, tl.fma(z, scale, w), mask)


@triton.jit(do_not_specialize=_NO_SPEC)
def _update_kernel(w_ptr, m_ptr, tid_bits, seeds_ptr, mw_ptr, G, scale, decay, start, n,
                   W, base, n0, n1, n2, n3, o0, o1, o2, o3, s0, s1, s2, s3,
                   MODE: tl.constexpr, HAS_DECAY: tl.constexpr, QUAD: tl.constexpr, BLOCK: tl.constexpr):
    """acc = scale * sum_g fma-accumulated mw[g] * eps(seed g), in registers; then by MODE:
    0: w = fma(w, decay, acc) (or w + acc); 1: m = m * decay + acc, w = m; 2: w = acc (an fp32 buffer)."""
    k, idx = _tile(start, W, base, n0, n1, n2, n3, o0, o1, o2, o3, s0, s1, s2, s3, QUAD, BLOCK)
    mask = k < n
    tid = tid_bits.to(tl.int64).to(tl.uint64, bitcast=True)
    acc = tl.full(k.shape, 0.0, tl.float32)  # builtins only: library @jit helpers are bound to one mode
    for g in range(0, G):
        seed = tl.load(seeds_ptr + g).to(tl.uint64, bitcast=True)
        acc = tl.fma(_eps(idx, seed, tid, QUAD), tl.load(mw_ptr + g), acc)
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
