"""On CUDA the snapshot and fp32 master are pinned and exactly the shards' size (no power-of-two rounding)."""
import pytest
import torch

from esopt_mp.es import Perturber
from esopt_mp.es.shard import LocalShard, ShardInfo

# torch.cuda.host_memory_stats(): the caching host allocator's bytes handed out now (its "allocated" bytes would
# not grow when a block an earlier test freed is handed out again)
ACTIVE = "active_bytes.current"


def _caching_host_bytes(key: str = ACTIVE) -> int:
    return int(torch.cuda.host_memory_stats().get(key, 0))


def _shards(dtype):
    sizes = [(1024, 10240), (768, 10240), (64, 16)]  # 70 MB in fp32: the caching allocator would take 128 MB
    dev = torch.device("cuda", torch.cuda.current_device())
    return [LocalShard(torch.randn(s, device=dev).to(dtype), ShardInfo.full(f"w{i}", s)) for i, s in enumerate(sizes)]


@pytest.mark.parametrize("dtype,master", [(torch.float32, "none"), (torch.bfloat16, "fp32_host")])
def test_pinned_bytes_equal_shard_bytes(dtype, master):
    shards = _shards(dtype)
    original = [s.tensor.clone() for s in shards]
    elem = 4 if master == "fp32_host" else dtype.itemsize
    n = sum(s.tensor.numel() for s in shards) * elem
    # a CUDA scalar read back (torch.equal, .item()) goes through the caching host allocator in a block of at most
    # 8 bytes; one now, so that the figure below counts only what the Perturber takes
    assert torch.equal(shards[-1].tensor, shards[-1].tensor)
    active = _caching_host_bytes(ACTIVE)  # handed out now: a block cached by an earlier test counts once reused
    p = Perturber(shards, restore="snapshot", master=master)
    p.perturb(11, 0.05)
    assert not torch.equal(shards[0].tensor, original[0])
    p.restore()
    host = p.master_host if master == "fp32_host" else p.snapshot_host
    assert host.pinned and all(t.is_pinned() for t in host.tensors)
    assert host.nbytes == n == p.host_bytes  # each shard's bytes are a multiple of 64: no padding at all
    # nothing the size of a shard is held from the rounding caching host allocator (scalar read-backs may be)
    assert _caching_host_bytes(ACTIVE) - active < min(s.tensor.numel() for s in shards) * elem
    if master == "none":
        assert all(torch.equal(s.tensor, o) for s, o in zip(shards, original))  # bit-exact restore
    rounded = torch.empty(n, dtype=torch.uint8, pin_memory=True)  # what the old code did, for the record
    assert _caching_host_bytes(ACTIVE) - active >= n
    del rounded
    host.release()
    assert not host.pinned
