"""Philox4x32-10 and Box-Muller in plain torch: the integer core of the noise spec.

Everything here works on int64 tensors holding uint32 words. Products of two
32-bit words wrap modulo 2**64 in int64 two's complement, which keeps the low
64 bits of the exact product; ``(p >> 32) & M32`` then recovers the high word
even when the wrapped value is negative. The Random123 known-answer vectors
(tests/unit/es/test_philox.py) pin this down, including the all-ones corner.

The same function runs eagerly on any device or through ``torch.compile``
(static code, dynamic length), giving bit-identical integers and, on the same
device, bit-identical floats.
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
import threading

import torch

M32 = 0xFFFFFFFF
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
TWO_PI = 2.0 * math.pi
INV_2_32 = 2.0**-32


def tensor_id(name: str) -> int:
    """First 8 bytes (little-endian) of BLAKE2b-64 over the UTF-8 canonical name."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def philox_rounds(c0, c1, c2, c3, k0, k1):
    """Ten Philox4x32 rounds; words may be int64 tensors or Python ints (< 2**32)."""
    for i in range(10):
        if i:
            k0 = (k0 + PHILOX_W0) & M32
            k1 = (k1 + PHILOX_W1) & M32
        p0 = c0 * PHILOX_M0
        p1 = c2 * PHILOX_M1
        c0, c1, c2, c3 = ((p1 >> 32) & M32) ^ c1 ^ k0, p1 & M32, ((p0 >> 32) & M32) ^ c3 ^ k1, p0 & M32
    return c0, c1, c2, c3


def philox4x32_10(counter: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
    """Raw Philox4x32-10: ``counter`` int64 [N, 4] of uint32 words -> int64 [N, 4]."""
    if counter.dtype != torch.int64 or counter.dim() != 2 or counter.shape[1] != 4:
        raise ValueError(f"counter must be an int64 tensor of shape [N, 4], got {counter.dtype} {tuple(counter.shape)}")
    k0, k1 = (int(k) & M32 for k in key)
    out = philox_rounds(*(counter[:, i] for i in range(4)), k0, k1)
    return torch.stack([o if torch.is_tensor(o) else torch.full_like(counter[:, 0], o) for o in out], dim=1)


def normals_kernel(q: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """float32 [N, 4] normals for counters ``q`` (int64 [N], the element index // 4).

    ``words`` is int64 [4] = (key0, key1, tid_lo, tid_hi) so that a compiled
    version never specialises on a seed or tensor name; or int64 [4, N], one
    column per counter (several tensors' counters in one call).
    """
    c0 = q & M32
    c1 = q >> 32
    c2 = words[2].expand_as(q)
    c3 = words[3].expand_as(q)
    x0, x1, x2, x3 = philox_rounds(c0, c1, c2, c3, words[0], words[1])
    u1a = (x0.double() + 1.0) * INV_2_32
    u1b = (x2.double() + 1.0) * INV_2_32
    ta = x1.double() * (INV_2_32 * TWO_PI)
    tb = x3.double() * (INV_2_32 * TWO_PI)
    ra = torch.sqrt(-2.0 * torch.log(u1a))
    rb = torch.sqrt(-2.0 * torch.log(u1b))
    return torch.stack([ra * torch.cos(ta), ra * torch.sin(ta), rb * torch.cos(tb), rb * torch.sin(tb)], dim=-1).float()


def key_words(seed: int, tid: int, device) -> torch.Tensor:
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"member seed must be a uint64, got {seed}")
    return torch.tensor([seed & M32, seed >> 32, tid & M32, tid >> 32], dtype=torch.int64, device=device)


_compiled = None
_compile_lock = threading.Lock()


def kernel_cache_dir() -> str:
    """Where inductor keeps compiled kernels across processes: ``TORCHINDUCTOR_CACHE_DIR`` if set, else
    ``$XDG_CACHE_HOME/esopt_mp/inductor`` (``~/.cache/...``), which outlives a job's /tmp on a cluster."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.environ["TORCHINDUCTOR_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "esopt_mp", "inductor")


def _marker() -> str:
    """A file naming this torch and Python: written once the kernel compiled into :func:`kernel_cache_dir`."""
    return os.path.join(kernel_cache_dir(), f"esopt_noise_kernel.torch-{torch.__version__}.py{sys.version_info[0]}"
                        f"{sys.version_info[1]}")


def kernel_cached() -> bool:
    """Whether an earlier process compiled the kernel into the cache this one uses (compiling is then ~3 s)."""
    return os.path.exists(_marker())


def _use_cache_dir() -> None:
    """Point inductor at :func:`kernel_cache_dir` (if it can be written; else inductor's own default)."""
    d = kernel_cache_dir()
    try:
        os.makedirs(d, exist_ok=True)
    except OSError:
        return
    if os.access(d, os.W_OK):
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", d)


def _compiled_kernel():
    """``normals_kernel`` through torch.compile; its first call leaves the marker of :func:`kernel_cached`."""
    compiled = torch.compile(normals_kernel, dynamic=True)
    state = {"first": True}

    def kernel(q, words):
        out = compiled(q, words)
        if state["first"]:
            state["first"] = False
            try:
                open(_marker(), "a").close()
            except OSError:
                pass
        return out

    return kernel


def get_kernel(backend: str = "eager"):
    """The normals kernel for ``backend`` in {"eager", "compile"}.

    ``compile`` costs ~20 s once per process with an empty kernel cache, ~3 s when an earlier process left the
    kernel in it (:func:`kernel_cache_dir`), and runs ~10x faster on CPU (``ESOPT_NOISE_BACKEND`` is applied by
    :mod:`esopt_mp.es.backend`).
    """
    if backend == "eager":
        return normals_kernel
    if backend != "compile":
        raise ValueError(f"unknown noise backend {backend!r}; expected 'eager' or 'compile'")
    global _compiled
    with _compile_lock:
        if _compiled is None:
            _use_cache_dir()
            _compiled = _compiled_kernel()
    return _compiled
