"""Which noise kernel runs where (``es.noise_backend``); every choice gives the same noise.

- ``triton``: the fused Triton kernels (:mod:`esopt_mp.es.triton_noise`): CUDA tensors, or CPU
  tensors under ``TRITON_INTERPRET=1`` (tests).
- ``compile``: the torch reference through ``torch.compile``: ~20 s once per process, then ~5x
  the eager throughput on CPU (docs/benchmarks.md, bench_noise: 186 vs 37 M elements/s on 2 cores).
- ``eager``: the torch reference as is.
- ``auto`` (default): triton on CUDA when Triton imports (else eager); on CPU ``compile`` when the noise the run
  will generate on the device repays the compiler's one-time cost, else ``eager``.

The CPU decision is on the work, not the shard size: a 494k-parameter agent trained for 40 steps at G=16
regenerates its noise ~1,300 times (6e8 elements), ~21 s eager at the ~30 M elements/s eager reaches on such small
tensors, ~4 s compiled; the compile costs ~20 s in a fresh process with an empty cache and ~4 s when inductor's
on-disk cache holds the kernel from an earlier run (:func:`esopt_mp.es.philox.get_kernel` keeps it in
``$XDG_CACHE_HOME/esopt_mp/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` says otherwise). Without a work estimate
(a caller that does not know the run), compile from :data:`AUTO_COMPILE_MIN_ELEMS` local elements on.
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
EAGER_ELEMS_PER_S = 30e6  # the eager reference on a small agent's tensors, grouped (2 CPU cores)
COMPILED_ELEMS_PER_S = 160e6  # the compiled kernel, same tensors
COMPILE_S = {"cold": 20.0, "warm": 4.0}  # the one-time cost: an empty inductor cache, or one holding the kernel


def compile_repays(work: float, warm: bool) -> tuple[bool, str]:
    """Whether compiling saves time over ``work`` noise elements, and the estimate that says so."""
    saved = work / EAGER_ELEMS_PER_S - work / COMPILED_ELEMS_PER_S
    cost = COMPILE_S["warm" if warm else "cold"]
    return saved > cost, (f"the run's {work:.2g} noise elements take ~{work / EAGER_ELEMS_PER_S:.0f} s eager, "
                          f"~{work / COMPILED_ELEMS_PER_S:.0f} s compiled, plus ~{cost:.0f} s to compile "
                          f"({'warm' if warm else 'empty'} kernel cache)")
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
