"""Giving freed heap back to the kernel. An ES step frees its noise buffers and member copies in large blocks that
glibc's allocator keeps; the trainer trims after the update so the next step's resident set starts from what is
live. Imports no torch (the memory sampler uses it too)."""
from __future__ import annotations

_TRIM = []  # [the C library's malloc_trim, or None], looked up once


def malloc_trim() -> bool:
    """Return glibc's free heap pages to the kernel (``malloc_trim(0)``); False where the C library lacks it."""
    if not _TRIM:
        try:
            import ctypes

            fn = ctypes.CDLL(None).malloc_trim
            fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim with
            fn = None
        _TRIM.append(fn)
    if _TRIM[0] is None:
        return False
    _TRIM[0](0)
    return True
