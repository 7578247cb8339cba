"""The noise spec (docs/concepts.md, "The noise") as Triton kernels fused with the ES
weight operations.

Each program takes BLOCK consecutive elements of a local shard, turns each local flat index into
its row-major index ``j`` in the canonical (unsharded) tensor from the ShardInfo geometry (run
width, outer local sizes, global offsets and strides: whole tensors, row / column / any box), and
computes eps(j) exactly as :func:`esopt_mp.es.philox.normals_kernel` does: Philox4x32-10 (the
rounds of ``tl.philox``) keyed by the member seed on counter ``(j//4, tid)``, the output word
pair of lane ``j % 4``, Box-Muller in float64, one float32 rounding. When every run of the box
starts at a multiple of 4 (whole tensors and row shards with numel % 4 == 0, column shards of
4-aligned widths and offsets) a program takes [BLOCK/4, 4] tiles instead, so one Philox call and two
Box-Muller pairs serve four elements (4x fewer Philox rounds, half the fp64 transcendentals, same
bits). The fp64 constant
2*pi*2**-32 is built from its bit pattern: a Python float literal in a Triton expression is an
fp32 constant.

Arithmetic mirrors the torch ops of :class:`esopt_mp.es.perturber.Perturber` one for one, so
results are bit-identical wherever eps is: ``w.add_(z, alpha=a)`` is one fused multiply-add in
fp32 (measured on CPU; on CUDA torch's ``a + alpha * b`` is contracted to an FMA by nvcc: checked by
the gpu test, not here), so the kernels call ``tl.fma`` there and launch
with ``enable_fp_fusion=False`` so that no other multiply and add is contracted (the master
update is a multiply then an add in torch). bf16/fp16 weights are read exactly into fp32,
computed in fp32 and rounded to nearest-even once on the store, as torch's mixed-dtype in-place
ops do.

Without CUDA, ``TRITON_INTERPRET=1`` runs these kernels on CPU tensors (numpy); that is how the
tests check them. The interpreter's float64 log/sin/cos/sqrt are numpy's, torch's CPU ones are
SLEEF's: they differ by one fp64 ulp on ~0.1% of inputs (sqrt on ~1%), which changes a float32
normal only when it lies within an ulp of a float32 rounding boundary (docs/concepts.md, "The noise").
"""
from __future__ import annotations

import importlib.util
import os
import struct
import threading

import torch

try:
    import triton
except ImportError:  # optional extra: pip install esopt_mp[triton]
    triton = None

MAX_OUTER = 4  # outer (non-run) dims of a sliced shard the kernels index; 5-d tensors and below
BLOCK = 1024


def available() -> bool:
    """Triton with the runtime knobs the kernel loader uses (Triton >= 3.4)."""
    return triton is not None and hasattr(triton, "knobs")


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
        raise ValueError(f"{info.name}: es.noise_backend=triton indexes at most {MAX_OUTER} dims outside the "
                         f"contiguous run of a box; this {len(info.global_shape)}-d box has {len(outer)}")
    pad = MAX_OUTER - len(outer)
    return (width, base, *((1,) * pad + tuple(outer)), *((0,) * pad + tuple(olo)),
            *((0,) * pad + tuple(ostride)))


def _quad_aligned(geom: tuple, start: int) -> bool:
    """Whether every run of the box, and ``start``, begin at a multiple of 4 (then the kernels compute
    each Philox counter once for its four elements): whole tensors and row shards with numel % 4 == 0,
    column shards of widths and offsets % 4 == 0."""
    width, base, strides = geom[0], geom[1], geom[2 + 2 * MAX_OUTER:]
    return width % 4 == 0 and base % 4 == 0 and start % 4 == 0 and all(s % 4 == 0 for s in strides)


_variants: dict = {}
_variants_lock = threading.Lock()


def _kernels(interpret: bool):
    """The kernel module bound to the interpreter or to the compiler (each loaded once)."""
    with _variants_lock:
        mod = _variants.get(interpret)
        if mod is None:
            path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_triton_kernels.py")
            name = f"esopt_mp.es._triton_kernels_{'interpreted' if interpret else 'compiled'}"
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            with triton.knobs.runtime.scope():
                triton.knobs.runtime.interpret = interpret
                spec.loader.exec_module(mod)
            _variants[interpret] = mod
    return mod


def _launch(name: str, flat: torch.Tensor, start: int, n: int, info, *args, **consts) -> None:
    check_device(flat.device)
    if n <= 0:
        return
    kernel = getattr(_kernels(flat.device.type != "cuda" or interpreting()), name)
    geom = _geometry(info)
    grid = (triton.cdiv(n, BLOCK),)
    kernel[grid](*args, start, n, *geom, QUAD=_quad_aligned(geom, start), BLOCK=BLOCK, enable_fp_fusion=False,
                 **consts)


def axpy_(out: torch.Tensor, seed: int, info, scale: float | None, start: int = 0) -> torch.Tensor:
    """``out`` (a contiguous 1-d view of local elements start..start+len) += scale * eps, or = eps
    when ``scale`` is None. Returns ``out``. Seed and tensor id go as scalars: no copy, no sync."""
    _launch("_axpy_kernel", out, start, out.numel(), info, out, _i64(info.tid), _i64(seed), _f32(scale or 0.0),
            STORE_EPS=scale is None)
    return out


def pack_members(members, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(seeds int64, weights fp32) on ``device``: uploaded once per update, shared by every shard's launch."""
    seeds = torch.tensor([_i64(s) for s, _ in members] or [0], dtype=torch.int64)
    weights = torch.tensor([_f32(x) for _, x in members] or [0.0], dtype=torch.float32)
    if torch.device(device).type == "cuda":
        seeds, weights = seeds.pin_memory(), weights.pin_memory()
    return seeds.to(device, non_blocking=True), weights.to(device, non_blocking=True)


def update_(w: torch.Tensor, info, members, scale: float, decay: float, *, master: torch.Tensor | None = None,
            start: int = 0, acc_only: bool = False, packed: tuple | None = None) -> None:
    """One pass over local elements start..start+len(w) for all ``members`` [(seed, weight)].

    ``w`` gets decay * w + scale * sum_g weight_g * eps_g (rounded once), or, with ``master`` on
    the same device, the master gets it and ``w`` its rounding; ``acc_only``: ``w`` (fp32) gets
    just scale * sum. The fp32 sum lives in registers: no accumulator in memory. ``packed``: the
    members from :func:`pack_members` (built once per update call instead of per shard).
    """
    mode = 2 if acc_only else (1 if master is not None else 0)
    if acc_only and w.dtype != torch.float32:
        raise ValueError("acc_only needs an fp32 output buffer")
    seeds, mw = packed if packed is not None else pack_members(members, w.device)
    m = master if master is not None else w
    _launch("_update_kernel", w, start, w.numel(), info, w, m, _i64(info.tid), seeds, mw, len(members), _f32(scale),
            _f32(decay), MODE=mode, HAS_DECAY=decay != 1.0)
