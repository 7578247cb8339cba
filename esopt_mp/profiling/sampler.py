"""Background memory sampler: device (NVML, torch's allocator) and host (RSS, kernel high-water mark).

A thread samples every ``interval_s``; :meth:`MemorySampler.mark` starts a
named phase (perturb, rollouts, restore, update...) and takes a sample at the
boundary, so even a phase shorter than the interval has one. Host peaks also
come from the kernel's own high-water mark (``VmHWM``), reset at each mark
through ``/proc/self/clear_refs`` where Linux allows: it catches spikes that
fall between two samples. Counters used, per figure:

- ``host``: psutil RSS samples, max'ed with ``VmHWM`` per phase; ``ru_maxrss``
  beside it, read before each reset (clear_refs lowers it too) and max'ed: the
  lifetime high-water mark. The kernel raises VmHWM lazily (on unmap, not when
  memory is freed with madvise), so neither source alone is the peak.
- ``device``: NVML ``usedGpuMemory`` of this process
  (``nvmlDeviceGetComputeRunningProcesses``) when the driver reports it, else
  the device's used memory (``nvmlDeviceGetMemoryInfo``, every process on it).
- ``torch``: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``,
  reset at each mark.

Without NVML (no GPU, no driver, no ``nvidia-ml-py``) the sampler says so once
and measures host memory only.

``malloc_trim``: at :meth:`MemorySampler.start` and at each mark, before the
next phase begins, glibc is asked to give its free heap pages back to the
kernel (``malloc_trim(0)``), so a phase starts from the memory that is live.
Without it RSS keeps what a phase freed but glibc retained: a tp=2 ES step's
first rollouts left up to ~140 MiB of free heap per rank, and the fp32
update chunk (a fresh mmap, too large for those pages) landed on top of it.
Off with ``malloc_trim=False``; a no-op where the C library has no
``malloc_trim`` (not glibc).
"""
from __future__ import annotations

import logging
import os
import resource
import threading
import time

from esopt_mp.es.hostmem import malloc_trim

log = logging.getLogger(__name__)
_NOTICED = False


def _notice_once(msg: str) -> None:
    global _NOTICED
    if not _NOTICED:
        _NOTICED = True
        log.warning(msg)


class _Nvml:
    """Device memory of one GPU through NVML: this process's share if the driver tells it, else the device's."""

    def __init__(self, device_index: int):
        import pynvml  # nvidia-ml-py, the [profile] extra

        pynvml.nvmlInit()
        self.nv = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        try:  # CUDA_VISIBLE_DEVICES renumbers devices; the PCI bus id does not change
            import torch

            p = torch.cuda.get_device_properties(device_index)
            bus = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
            self.handle = pynvml.nvmlDeviceGetHandleByPciBusId_v2(bus)
        except Exception:  # noqa: BLE001 - older torch without PCI ids: the index is right without remapping
            pass
        self.pid = os.getpid()
        self.counter = "nvml_process" if self._process() is not None else "nvml_device"

    def _process(self):
        try:
            for p in self.nv.nvmlDeviceGetComputeRunningProcesses(self.handle):
                if p.pid == self.pid and p.usedGpuMemory is not None:
                    return int(p.usedGpuMemory)
        except self.nv.NVMLError:
            return None
        return None

    def used(self) -> int:
        if self.counter == "nvml_process":
            v = self._process()
            if v is not None:
                return v
        return int(self.nv.nvmlDeviceGetMemoryInfo(self.handle).used)


def _read_hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident set size to the current one
        return True
    except OSError:
        return False


def ru_maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class MemorySampler:
    """Samples memory in a thread; ``mark(phase)`` starts a phase; :meth:`summary` gives peaks per phase."""

    def __init__(self, interval_s: float = 0.01, use_nvml: bool = True, cuda: bool | None = None,
                 malloc_trim: bool = True):
        import psutil
        import torch

        self.interval_s = float(interval_s)
        self.malloc_trim = bool(malloc_trim)  # free heap pages back to the kernel at start() and at each mark
        self.proc = psutil.Process()
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.nvml = None
        if use_nvml:
            if not self.cuda:
                _notice_once("NVML unavailable (no CUDA device): measuring host memory only")
            else:
                try:
                    self.nvml = _Nvml(torch.cuda.current_device())
                except Exception as e:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, driver errors
                    _notice_once(f"NVML unavailable ({type(e).__name__}: {e}): device memory from torch's "
                                 f"allocator statistics only")
        self.t0 = time.perf_counter()
        self.samples: list[tuple[float, int, int | None]] = []  # (t, host rss, device used)
        self.marks: list[tuple[float, str]] = []
        self.phase_extra: dict[str, dict[str, int]] = {}  # per phase: kernel HWM, torch peaks
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.hwm_resettable = False
        self.ru_maxrss_bytes = ru_maxrss_bytes()  # lifetime maximum, kept across the HWM resets

    # ------------------------------------------------------------------ sampling
    def sample(self) -> tuple[float, int, int | None]:
        # time and readings under the lock that mark() takes to start a phase: a sample is read wholly before or
        # wholly after a mark (the thread, timed in one phase and stalled, once read the next phase's RSS into it)
        with self._lock:
            s = (time.perf_counter() - self.t0, int(self.proc.memory_info().rss),
                 self.nvml.used() if self.nvml is not None else None)
            self.samples.append(s)
        return s

    def _run(self):
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> "MemorySampler":
        if self.malloc_trim:
            malloc_trim()
        self.hwm_resettable = _reset_hwm()
        self.sample()
        self._thread = threading.Thread(target=self._run, name="memprof-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self._close_phase()
        self.sample()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ------------------------------------------------------------------ phases
    def _close_phase(self) -> None:
        """Record the kernel and torch peaks of the phase that ends now, then reset them for the next."""
        if not self.marks:
            return
        import torch

        self.ru_maxrss_bytes = max(self.ru_maxrss_bytes, ru_maxrss_bytes())
        name = self.marks[-1][1]
        extra = self.phase_extra.setdefault(name, {})
        hwm = _read_hwm() if self.hwm_resettable else None
        if hwm is not None:
            extra["host_hwm_bytes"] = max(extra.get("host_hwm_bytes", 0), hwm)
        if self.cuda:
            extra["torch_max_allocated_bytes"] = max(extra.get("torch_max_allocated_bytes", 0),
                                                     int(torch.cuda.max_memory_allocated()))
            extra["torch_max_reserved_bytes"] = max(extra.get("torch_max_reserved_bytes", 0),
                                                    int(torch.cuda.max_memory_reserved()))

    def mark(self, phase: str) -> None:
        """End the current phase (if any) and start ``phase``; a phase may recur (G perturb phases)."""
        import torch

        self.sample()
        self._close_phase()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if self.malloc_trim:  # the next phase starts from live memory, not from the heap the last one freed
            malloc_trim()
        if self.hwm_resettable:
            _reset_hwm()
        with self._lock:
            self.marks.append((time.perf_counter() - self.t0, phase))
        self.sample()

    def phase_at(self, t: float) -> str | None:
        name = None
        for tm, ph in self.marks:
            if tm <= t:
                name = ph
            else:
                break
        return name

    # ------------------------------------------------------------------ results
    def phase_peaks(self, since: str | None = None) -> dict[str, dict[str, int]]:
        """Per phase: peak host bytes (samples and kernel HWM), peak device bytes, torch peaks."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            samples = list(self.samples)
        for t, host, dev in samples:
            ph = self.phase_at(t)
            if ph is None:
                continue
            d = out.setdefault(ph, {"host_peak_bytes": 0})
            d["host_peak_bytes"] = max(d["host_peak_bytes"], host)
            if dev is not None:
                d["device_peak_bytes"] = max(d.get("device_peak_bytes", 0), dev)
        for ph, extra in self.phase_extra.items():
            d = out.setdefault(ph, {"host_peak_bytes": 0})
            if "host_hwm_bytes" in extra:
                d["host_peak_bytes"] = max(d["host_peak_bytes"], extra["host_hwm_bytes"])
            for k in ("torch_max_allocated_bytes", "torch_max_reserved_bytes"):
                if k in extra:
                    d[k] = extra[k]
        return out

    def peak(self, phases) -> dict[str, int]:
        """Max over ``phases`` of each per-phase figure."""
        res: dict[str, int] = {}
        for ph, d in self.phase_peaks().items():
            if ph in phases:
                for k, v in d.items():
                    res[k] = max(res.get(k, 0), v)
        return res

    def timeline(self) -> dict:
        with self._lock:
            samples = list(self.samples)
        return {"t": [s[0] for s in samples], "host_rss": [s[1] for s in samples],
                "device": [s[2] for s in samples] if self.nvml is not None else None,
                "marks": [[t, p] for t, p in self.marks]}

    @property
    def device_counter(self) -> str | None:
        if self.nvml is not None:
            return self.nvml.counter
        return "torch" if self.cuda else None
