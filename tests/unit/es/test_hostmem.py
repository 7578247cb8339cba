"""Host copies take the shards' size (their storage, counted), in every precision mode."""
import pytest
import torch

from esopt_mp.es.hostmem import HostCopies


@pytest.mark.parametrize("dtype,master", [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "fp32_host")])
def test_snapshot_and_master_take_the_shard_size(dtype, master):
    """Counted from the storage the perturber holds (the resident memory it takes, which depends on the allocator
    and the machine's load, is measured by tools/memprof.py's es_snapshot profiles: "host by design" in its JSON)."""
    from esopt_mp.es import Perturber
    from esopt_mp.es.shard import LocalShard, ShardInfo

    dt = getattr(torch, dtype)
    sizes = [(64, 160), (48, 160), (3, 5)]  # the last one far from 64-byte alignment
    shards = [LocalShard(torch.randn(s).to(dt), ShardInfo.full(f"w{i}", s)) for i, s in enumerate(sizes)]
    before = [s.tensor.clone() for s in shards]
    p = Perturber(shards, restore="snapshot", master=master, chunk_elems=1 << 16, block=1 << 14,
                  noise_backend="eager")
    p.perturb(7, 0.1)
    held = p.master_host if master == "fp32_host" else p.snapshot_host
    assert (p.snapshot_host is None) == (master == "fp32_host")  # the fp32 master restores: no second copy
    elem = 4 if master == "fp32_host" else dt.itemsize
    n = sum(s.tensor.numel() for s in shards) * elem
    storage = held.buffer.untyped_storage()
    assert p.host_bytes == storage.nbytes() and n <= storage.nbytes() < n + 64 * len(sizes)  # 64-byte alignment
    shard_ptrs = {s.tensor.untyped_storage().data_ptr() for s in shards}
    assert storage.data_ptr() not in shard_ptrs  # a copy of its own, not a view of the weights
    assert {t.untyped_storage().data_ptr() for t in held.tensors} == {storage.data_ptr()}
    assert all(torch.equal(c, b.to(c.dtype)) for c, b in zip(held.tensors, before))  # it holds the weights
    assert not all(torch.equal(s.tensor, b) for s, b in zip(shards, before))  # while they are perturbed
    p.restore()
    assert all(torch.equal(s.tensor, b) for s, b in zip(shards, before))


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
