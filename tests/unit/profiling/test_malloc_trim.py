"""The sampler gives glibc's free heap back to the kernel at start and at each mark, so a phase starts from live
memory: freed-but-retained heap from one phase (a tp=2 rollout's) must not sit under the next one's peak."""
import gc

import psutil
import pytest

from esopt_mp.profiling import sampler as sampler_mod
from esopt_mp.profiling.sampler import MemorySampler, malloc_trim

MB = 1 << 20


def _counting(monkeypatch):
    calls = []
    monkeypatch.setattr(sampler_mod, "malloc_trim", lambda: calls.append(1) or True)
    return calls


def test_trims_at_start_and_at_every_mark(monkeypatch):
    calls = _counting(monkeypatch)
    s = MemorySampler(3600, use_nvml=False, cuda=False).start()  # the thread never fires
    assert len(calls) == 1  # before the baseline sample
    for ph in ("perturb", "rollouts", "restore", "update"):
        s.mark(ph)
    s.stop()
    assert len(calls) == 5


def test_no_trim_when_off(monkeypatch):
    calls = _counting(monkeypatch)
    s = MemorySampler(3600, use_nvml=False, cuda=False, malloc_trim=False).start()
    s.mark("rollouts")
    s.mark("update")
    s.stop()
    assert calls == []


def test_trim_returns_freed_heap_to_the_kernel():
    """200 MiB of heap-sized pieces (below glibc's mmap threshold), freed under a live piece that pins the heap's
    top: RSS keeps them until malloc_trim."""
    proc = psutil.Process()
    if not malloc_trim():
        pytest.skip("the C library has no malloc_trim (not glibc)")
    r0 = proc.memory_info().rss
    bufs = [bytearray(8192) for _ in range(25600)]
    pin = bytearray(8192)  # noqa: F841 - keeps the freed pieces below the top of the heap
    grown = proc.memory_info().rss - r0
    del bufs
    gc.collect()
    kept = proc.memory_info().rss - r0
    assert malloc_trim()
    after = proc.memory_info().rss - r0
    assert grown > 150 * MB
    assert after < kept - 100 * MB, (grown // MB, kept // MB, after // MB)
