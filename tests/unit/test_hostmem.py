"""Host copies take the shards' size, measured as resident memory (psutil RSS), in every precision mode."""
import json
import subprocess
import sys

import pytest
import torch

from esopt_mp.es.hostmem import HostCopies

MB = 1 << 20


_PROBE = """
import json, sys, psutil, torch
from esopt_mp.es import LocalShard, Perturber, ShardInfo
torch.set_num_threads(1)
dtype, master = getattr(torch, sys.argv[1]), sys.argv[2]
# 3 tensors, 40 MB + 30 MB + a few bytes in fp32: far from a power of two (the caching host allocator's 128 MB)
sizes = [(1024, 10240), (768, 10240), (3, 5)]
shards = [LocalShard(torch.randn(s).to(dtype), ShardInfo.full(f"w{i}", s)) for i, s in enumerate(sizes)]
warm = Perturber([LocalShard(torch.zeros(1 << 16, dtype=dtype), ShardInfo.full("x", (1 << 16,)))],
                 restore="snapshot", master=master, chunk_elems=1 << 16, block=1 << 14, noise_backend="eager")
warm.perturb(1, 0.1)  # one-time costs (noise kernels, allocator arenas) are not the snapshot's
warm.restore()
before = psutil.Process().memory_info().rss
p = Perturber(shards, restore="snapshot", master=master, chunk_elems=1 << 16, block=1 << 14,
              noise_backend="eager")  # auto would compile at 18M elements: its memory is not the snapshot's
p.perturb(7, 0.1)
p.restore()
grown = psutil.Process().memory_info().rss - before
print(json.dumps({"numel": sum(s.tensor.numel() for s in shards), "host_bytes": p.host_bytes, "grown": grown}))
"""


@pytest.mark.parametrize("dtype,master", [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "fp32_host")])
def test_snapshot_and_master_take_the_shard_size(dtype, master):
    # A fresh interpreter per case: in a long pytest process glibc's dynamic mmap threshold lets a new buffer land
    # in pages an earlier test freed but kept resident, and RSS then grows by nothing.
    out = subprocess.run([sys.executable, "-c", _PROBE, dtype, master], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    elem = 4 if master == "fp32_host" else getattr(torch, dtype).itemsize
    n, grown = r["numel"] * elem, r["grown"]
    assert r["host_bytes"] >= n and r["host_bytes"] - n < 64 * 3  # exact up to 64-byte alignment
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
