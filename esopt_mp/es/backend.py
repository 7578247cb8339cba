"""Which noise kernel runs where (``es.noise_backend``); every choice gives the same noise.

- ``triton``: the fused Triton kernels (:mod:`esopt_mp.es.triton_noise`): CUDA tensors, or CPU
  tensors under ``TRITON_INTERPRET=1`` (tests).
- ``compile``: the torch reference through ``torch.compile``: ~20 s once per process, then ~5x
  the eager throughput on CPU (docs/benchmarks.md, bench_noise: 186 vs 37 M elements/s on 2 cores).
- ``eager``: the torch reference as is.
- ``auto`` (default): triton on CUDA when Triton imports (else eager); on CPU ``compile`` when the noise the run
  will generate on the device repays the compiler's one-time cost, else ``eager``.

The CPU decision is on the work, not the shard size, and in elements, not seconds: compiling repays when the noise
the run will generate saves more eager time than the compile costs. Taken to first order, both sides scale with the
machine's speed (a core twice as fast runs the eager kernel and the compiler about twice as fast), so the break-even
point is a number of elements, measured once (bench_noise, 2 CPU cores: eager ~30 M elements/s on a small agent's
tensors, compiled ~5.3x that, the compile ~20 s with an empty inductor cache and ~4 s when its on-disk cache holds
the kernel): about 7e8 elements cold and 1.5e8 warm. A 494k-parameter agent trained for 40 steps at G=16 regenerates
its noise ~1,300 times (6e8 elements): compiled when the cache is warm (:func:`esopt_mp.es.philox.get_kernel` keeps
it in ``$XDG_CACHE_HOME/esopt_mp/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` says otherwise), eager in a fresh
one. Not measured elsewhere: on many cores the eager kernel gains from torch's threads while the compile, mostly
serial, does not, so the true break-even is higher there and ``auto`` compiles somewhat early (``es.noise_backend``
or ``ESOPT_NOISE_BACKEND`` sets the backend). Without a work estimate (a caller that does not know the run), compile
from :data:`AUTO_COMPILE_MIN_ELEMS` local elements on.
"""
from __future__ import annotations

import importlib.util
import logging
import os

import torch

from esopt_mp.es.config import NOISE_BACKENDS
from esopt_mp.typed import check_choice

log = logging.getLogger(__name__)

AUTO_COMPILE_MIN_ELEMS = 1 << 24
COMPILED_SPEEDUP = 160 / 30  # the compiled kernel's throughput over the eager reference's, same tensors
# noise elements whose eager time equals the compile's cost (the eager rate times the compile's seconds, both
# measured on one machine; their product does not depend on its speed): an empty inductor cache, or one holding it
COMPILE_COST_ELEMS = {"cold": 20.0 * 30e6, "warm": 4.0 * 30e6}


def compile_repays(work: float, warm: bool) -> tuple[bool, str]:
    """Whether compiling saves time over ``work`` noise elements, and the estimate that says so."""
    cost = COMPILE_COST_ELEMS["warm" if warm else "cold"]
    break_even = cost / (1 - 1 / COMPILED_SPEEDUP)
    return work > break_even, (f"the run generates {work:.2g} noise elements; compiling (~{COMPILED_SPEEDUP:.1f}x "
                               f"eager) repays from ~{break_even:.2g} with {'a warm' if warm else 'an empty'} "
                               "kernel cache")


_logged: set = set()


def triton_importable() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    from esopt_mp.es import triton_noise
    return triton_noise.available()


def _triton_works(device) -> tuple[bool, str]:
    """One tiny launch against the torch reference (once per device): Triton may import and still be unable
    to build its launcher (no C compiler) or compile for this GPU; auto then falls back instead of crashing."""
    if device in _probed:
        return _probed[device]
    from esopt_mp.es import triton_noise
    from esopt_mp.es.philox import key_words, normals_kernel
    from esopt_mp.es.shard import ShardInfo

    info = ShardInfo.full("esopt.backend.probe", (64,))
    want = normals_kernel(torch.arange(16), key_words(12345, info.tid, "cpu")).view(-1)  # elements 0..63, eager
    try:
        got = triton_noise.axpy_(torch.zeros(64, device=device), 12345, info, None)
        ok = torch.equal(got.cpu(), want)
        why = "" if ok else "its noise differs from the torch reference on this device"
    except Exception as e:  # noqa: BLE001 - any failure to build or run means: do not use it
        ok, why = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    _probed[device] = (ok, why)
    return ok, why


_probed: dict = {}


def resolve(backend: str, device, numel: int, work: float | None = None, warm: bool | None = None) -> str:
    """The concrete backend for ``numel`` local elements on ``device``; logs auto's choice once.

    ``work``: the noise elements the run will generate on the device (None: unknown, decide on ``numel``);
    ``warm``: whether the kernel cache holds the compiled kernel (None: this process looks; a run passes what all
    its ranks agreed on, so every rank takes the same backend).
    ``ESOPT_NOISE_BACKEND`` overrides ``es.noise_backend`` (any of :data:`~esopt_mp.es.config.NOISE_BACKENDS`)."""
    backend = os.environ.get("ESOPT_NOISE_BACKEND", backend)
    check_choice(backend, NOISE_BACKENDS, "es.noise_backend")
    device = torch.device(device)
    if backend == "triton":
        from esopt_mp.es import triton_noise
        triton_noise.check_device(device)  # raises, naming es.noise_backend, without Triton or CUDA
        return backend
    if backend != "auto":
        return backend
    works, failure = _triton_works(device) if device.type == "cuda" and triton_importable() else (False, "")
    if works:
        choice, why = "triton", "CUDA tensors, Triton builds and matches the torch reference"
    elif failure:
        choice, why = "eager", f"Triton imports but fails here ({failure})"
        log.warning("es.noise_backend=auto: %s; using eager", why)
    elif device.type == "cuda":
        choice, why = "eager", "CUDA tensors, Triton not importable (inductor needs it too)"
    elif work is not None:
        from esopt_mp.es.philox import kernel_cached

        repays, why = compile_repays(work, kernel_cached() if warm is None else warm)
        choice = "compile" if repays else "eager"
    elif numel >= AUTO_COMPILE_MIN_ELEMS:
        choice, why = "compile", f"{numel} local elements >= {AUTO_COMPILE_MIN_ELEMS} repay torch.compile"
    else:
        choice, why = "eager", f"{numel} local elements < {AUTO_COMPILE_MIN_ELEMS}: compiling would not repay"
    if (device.type, choice) not in _logged:
        _logged.add((device.type, choice))
        log.info("es.noise_backend=auto -> %s on %s (%s)", choice, device.type, why)
    return choice
