"""Memory sampler, profiling shapes, the fits-in-memory check and memprof's one-line errors."""
import logging
import os
import sys
import time

import psutil
import pytest
import torch

from esopt_mp.profiling import sampler as sampler_mod
from esopt_mp.profiling.sampler import MemorySampler
from esopt_mp.profiling.shapes import param_count, shape_config

MB = 1 << 20


def test_sampler_sees_a_200mb_buffer_in_its_phase(monkeypatch):
    """Phase attribution on scripted readings: a real process's RSS growth depends on the allocator and on what else
    the machine runs; the profiles' measured figures are tools/memprof.py's (its JSON)."""
    from types import SimpleNamespace

    monkeypatch.setattr(sampler_mod, "_reset_hwm", lambda: False)  # the samples only, not the kernel's VmHWM
    maxrss = iter([500 * MB, 200 * MB, 200 * MB, 200 * MB, 200 * MB, 200 * MB])  # the kernel's lifetime maximum
    monkeypatch.setattr(sampler_mod, "ru_maxrss_bytes", lambda: next(maxrss))
    rss = [100 * MB]

    class Proc:
        def memory_info(self):
            return SimpleNamespace(rss=rss[0])

    s = MemorySampler(3600, use_nvml=False, cuda=False)  # the thread never fires: mark() and sample() read
    s.proc = Proc()
    s.start()
    s.mark("idle")
    s.mark("alloc")
    rss[0] = 300 * MB  # a 200 MB buffer, allocated once the phase has begun
    s.sample()
    rss[0] = 100 * MB  # freed before the next mark
    s.mark("freed")
    s.stop()
    peaks = s.phase_peaks()
    assert [p for _, p in s.marks] == ["idle", "alloc", "freed"]
    assert peaks["alloc"]["host_peak_bytes"] - peaks["idle"]["host_peak_bytes"] == 200 * MB
    assert peaks["freed"]["host_peak_bytes"] == peaks["alloc"]["host_peak_bytes"] - 200 * MB
    assert s.peak(("idle", "alloc"))["host_peak_bytes"] == peaks["alloc"]["host_peak_bytes"]
    assert s.ru_maxrss_bytes == 500 * MB  # kept across the VmHWM resets
    tl = s.timeline()
    assert len(tl["t"]) == len(tl["host_rss"]) >= 7 and tl["device"] is None and len(tl["marks"]) == 3


def test_a_sample_is_read_wholly_before_or_after_a_mark(monkeypatch):
    """The sampler thread times a sample, stalls, then reads RSS: the reading must not land after the next mark."""
    import threading
    from types import SimpleNamespace

    monkeypatch.setattr(sampler_mod, "_reset_hwm", lambda: False)  # the samples only, not the kernel's VmHWM
    s = MemorySampler(0.005, use_nvml=False, cuda=False)
    rss, reading = [100 * MB], threading.Event()

    class SlowProc:
        def memory_info(self):
            if threading.current_thread() is not threading.main_thread() and not reading.is_set():
                reading.set()
                time.sleep(0.2)  # the thread stalls between its timestamp and its reading
            return SimpleNamespace(rss=rss[0])

    s.proc = SlowProc()
    s.start()
    s.mark("idle")
    assert reading.wait(5)
    s.mark("alloc")
    rss[0] = 300 * MB  # allocated once the phase has begun
    time.sleep(0.05)
    s.stop()
    peaks = s.phase_peaks()
    assert peaks["idle"]["host_peak_bytes"] == 100 * MB and peaks["alloc"]["host_peak_bytes"] == 300 * MB, peaks


def test_sampler_thread_samples_between_marks():
    """The background thread, not the marks, produces the timeline: with one mark made, samples keep coming
    (waited for, not timed: a loaded machine may run the thread late, never not at all)."""
    s = MemorySampler(0.01, use_nvml=False, cuda=False).start()
    s.mark("wait")
    marked = len(s.timeline()["t"])
    deadline = time.monotonic() + 60
    while len(s.timeline()["t"]) < marked + 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    s.stop()
    t = s.timeline()["t"]
    assert len(t) >= marked + 10, (marked, len(t))  # ten samples after the last mark: the thread's
    assert t == sorted(t)


def test_sampler_phase_recurs_and_short_phases_have_a_sample():
    s = MemorySampler(10.0, use_nvml=False, cuda=False).start()  # the thread never fires: marks sample
    for ph in ("perturb", "rollouts", "restore", "perturb", "rollouts", "restore", "update"):
        s.mark(ph)
    s.stop()
    assert set(s.phase_peaks()) == {"perturb", "rollouts", "restore", "update"}
    assert s.phase_at(s.marks[3][0]) == "perturb"


def test_nvml_missing_notice_once(caplog, monkeypatch):
    monkeypatch.setattr(sampler_mod, "_NOTICED", False)
    with caplog.at_level(logging.WARNING, logger="esopt_mp.profiling.sampler"):
        a = MemorySampler(cuda=False)
        MemorySampler(cuda=False)
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["NVML unavailable (no CUDA device): measuring host memory only"]
    assert a.nvml is None and a.device_counter is None


def test_nvml_import_failure_is_a_notice(caplog, monkeypatch):
    monkeypatch.setattr(sampler_mod, "_NOTICED", False)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with caplog.at_level(logging.WARNING, logger="esopt_mp.profiling.sampler"):
        s = MemorySampler(cuda=True)
    assert s.nvml is None and s.device_counter == "torch"
    (rec,) = caplog.records
    assert rec.getMessage().startswith("NVML unavailable (ModuleNotFoundError")


def test_meta_4b_has_the_published_size_without_allocating():
    from esopt_mp.profiling.shapes import build_meta

    n = param_count(shape_config("4b"))
    assert 4.0e9 < n < 4.4e9, n
    model = build_meta(shape_config("4b"))  # what param_count counts: every tensor on the meta device, no storage
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert sum(p.numel() for p in model.parameters()) == n


def test_cpu_shape_is_real_qwen35_at_04b():
    c = shape_config("0.4b")
    assert param_count(c) >= 0.4e9
    assert c.vocab_size == 248320 and c.head_dim == 256
    assert (c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim) == (128, 128, 4)
    assert c.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    with pytest.raises(ValueError, match="--shape"):
        shape_config("70b")


def test_fits_check_says_one_line():
    from esopt_mp.profiling.fit import check_fits
    from esopt_mp.profiling.workload import Workload

    c = shape_config("27b")
    n = param_count(c)
    msg = check_fits("27b", c, n, ["inference"], 1, 1, Workload(), cuda_free=None, host_available=20 * 10**9)
    assert msg.startswith("shape 27b needs ~") and "20.0 GB available" in msg and "\n" not in msg
    assert check_fits("27b", c, n, ["inference"], 1, 1, Workload(), cuda_free=None, host_available=10**12) is None
    gpu = check_fits("27b", c, n, ["es_subtract"], 8, 8, Workload(), cuda_free=4 * 10**9, host_available=10**12)
    assert "GPU memory per rank" in gpu and "tp=8" in gpu


def _memprof(argv, capsys):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    from tools import memprof

    rc = memprof.main(argv)
    return rc, capsys.readouterr()


def test_memprof_too_big_exits_before_allocating(tmp_path, capsys, monkeypatch):
    class VM:
        available = 20 * 10**9

    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    from tools import memprof

    spawned = []  # the checkpoint and every profile are built in child processes: none may start
    monkeypatch.setattr(memprof, "_spawn", lambda *a, **k: spawned.append(a) or (1, "not allowed"))
    rc, out = _memprof(["--shape", "27b", "--out", str(tmp_path / "o"), "--profiles", "inference"], capsys)
    assert rc == 2 and out.out == ""
    assert out.err.count("\n") == 1 and "shape 27b needs ~" in out.err and "20.0 GB available" in out.err
    assert not (tmp_path / "o").exists() and spawned == []


def test_memprof_bad_inputs_one_line(tmp_path, capsys):
    for argv, text in ((["--shape", "70b"], "--shape must be one of"),
                       (["--shape", "tiny", "--tp", "2"], "--tp 2 needs exactly 2 ranks"),
                       (["--shape", "tiny", "--batch", "3"], "--batch 3 must be a multiple of --group-size 2")):
        rc, out = _memprof(argv + ["--out", str(tmp_path / "o")], capsys)
        assert rc == 2 and out.err.count("\n") == 1 and text in out.err, out.err
