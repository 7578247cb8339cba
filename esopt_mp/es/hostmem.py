"""Host memory of an ES step: copies of the local shards in one exact-size allocation, pinned on CUDA, and the
freed heap given back to the kernel. Imports torch only when a copy is made (the memory sampler trims too).

``torch.empty(..., pin_memory=True)`` goes through torch's caching host
allocator, which rounds every allocation up to a power of two
(``ATen/core/CachingHostAllocator.h``: ``PowerOf2Ceil(size)`` unless
``pinned_max_round_threshold`` is configured): a 1.27 GB shard takes 2 GB.
:class:`HostCopies` makes one plain host allocation covering all shards
(each 64-byte aligned), pins it with ``cudaHostRegister`` when the shards live
on a GPU and unregisters it when released, so host memory is the shards' size.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_ALIGN = 64
_TRIM = []  # [the C library's malloc_trim, or None], looked up once


def malloc_trim() -> bool:
    """Return glibc's free heap pages to the kernel (``malloc_trim(0)``); False where the C library lacks it.

    An ES step frees its noise buffers and member copies in large blocks that glibc's allocator keeps; the trainer
    trims after the update so the next step's resident set starts from what is live."""
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


def _unregister(ptr: int, buffer: "torch.Tensor") -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(ptr)


class HostCopies:
    """Host tensors shaped like ``tensors`` (optionally in another dtype), views of one buffer."""

    def __init__(self, tensors: list[torch.Tensor], dtype: torch.dtype | None = None):
        import torch

        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * (dtype or t.dtype).itemsize // _ALIGN) * _ALIGN
        self.nbytes = total
        self.buffer = torch.empty(total, dtype=torch.uint8)  # plain allocation: exactly `total` bytes
        self.pinned = False
        if total and any(t.is_cuda for t in tensors):
            cudart = torch.cuda.cudart()
            ptr = self.buffer.data_ptr()
            err = cudart.cudaHostRegister(ptr, total, 0)  # cudaHostRegisterDefault
            if err != cudart.cudaError.success:
                raise RuntimeError(f"cudaHostRegister of {total} bytes failed: {cudart.cudaGetErrorString(err)} "
                                   f"(cudaError {int(err)}); the locked-memory limit (ulimit -l) may be too low")
            self.pinned = True
            # holds the buffer until it is unregistered, so the memory is never freed while pinned
            self._finalizer = weakref.finalize(self, _unregister, ptr, self.buffer)
        self.tensors = []
        for t, off in zip(tensors, offsets):
            dt = dtype or t.dtype
            n = t.numel() * dt.itemsize
            self.tensors.append(self.buffer[off : off + n].view(dt).view(t.shape))

    def copy_from_(self, tensors: list[torch.Tensor]) -> "HostCopies":
        for dst, src in zip(self.tensors, tensors):
            dst.copy_(src)
        return self

    def release(self) -> None:
        """Unpin now (the memory goes when the last view does)."""
        if self.pinned:
            self._finalizer()
            self.pinned = False
        self.tensors, self.buffer = [], None
