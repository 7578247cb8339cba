"""Host copies take the shards' size, measured as resident memory (psutil RSS), in every precision mode."""
import psutil
import pytest
import torch

from esopt_mp.es import LocalShard, Perturber, ShardInfo
from esopt_mp.es.hostmem import HostCopies

MB = 1 << 20


def _shards(dtype):
    # 3 tensors, 40 MB + 30 MB + a few bytes in fp32: far from a power of two (the caching host allocator's 128 MB)
    sizes = [(1024, 10240), (768, 10240), (3, 5)]
    return [LocalShard(torch.randn(s).to(dtype), ShardInfo.full(f"w{i}", s)) for i, s in enumerate(sizes)]


def _rss():
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("dtype,master", [(torch.float32, "none"), (torch.bfloat16, "none"),
                                          (torch.bfloat16, "fp32_host")])
def test_snapshot_and_master_take_the_shard_size(dtype, master):
    shards = _shards(dtype)
    elem = 4 if master == "fp32_host" else dtype.itemsize
    n = sum(s.tensor.numel() for s in shards) * elem
    warm = Perturber([LocalShard(torch.zeros(1 << 16, dtype=dtype), ShardInfo.full("x", (1 << 16,)))],
                     restore="snapshot", master=master, chunk_elems=1 << 16, block=1 << 14)
    warm.perturb(1, 0.1)  # one-time costs (noise kernels, allocator arenas) are not the snapshot's
    warm.restore()
    before = _rss()
    p = Perturber(shards, restore="snapshot", master=master, chunk_elems=1 << 16, block=1 << 14)
    p.perturb(7, 0.1)
    p.restore()
    grown = _rss() - before
    assert p.host_bytes >= n and p.host_bytes - n < 64 * len(shards)  # exact up to 64-byte alignment
    assert n - 2 * MB <= grown <= n + 8 * MB, f"{grown / MB:.1f} MB resident for {n / MB:.1f} MB of shards"


def test_host_copies_are_views_of_one_buffer_and_round_trip():
    ts = [torch.randn(5, 3), torch.randn(7).to(torch.bfloat16), torch.randn(2, 2, 2).to(torch.float16)]
    h = HostCopies(ts).copy_from_(ts)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(h.tensors, ts))
    assert {t.untyped_storage().data_ptr() for t in h.tensors} == {h.buffer.untyped_storage().data_ptr()}
    assert all(t.data_ptr() % 64 == 0 for t in h.tensors) and h.nbytes == 64 + 64 + 64
    assert not h.pinned  # CPU shards need no pinning
    f = HostCopies(ts, torch.float32).copy_from_(ts)
    assert all(t.dtype == torch.float32 and torch.equal(t, s.float()) for t, s in zip(f.tensors, ts))
    h.release()
    assert h.tensors == [] and h.buffer is None
