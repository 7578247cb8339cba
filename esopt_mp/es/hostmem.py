"""Host copies of the local shards in one exact-size allocation, pinned on CUDA.

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

import torch

_ALIGN = 64


def _unregister(ptr: int, buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class HostCopies:
    """Host tensors shaped like ``tensors`` (optionally in another dtype), views of one buffer."""

    def __init__(self, tensors: list[torch.Tensor], dtype: torch.dtype | None = None):
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
