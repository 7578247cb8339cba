"""Which noise kernel runs where (``es.noise_backend``); every choice gives the same noise.

- ``triton``: the fused Triton kernels (:mod:`esopt_mp.es.triton_noise`): CUDA tensors, or CPU
  tensors under ``TRITON_INTERPRET=1`` (tests).
- ``compile``: the torch reference through ``torch.compile``: ~20 s once per process, then ~5x
  the eager throughput on CPU (docs/benchmarks.md, bench_noise: 186 vs 37 M elements/s on 2 cores).
- ``eager``: the torch reference as is.
- ``auto`` (default): triton on CUDA when Triton imports (else eager); on CPU ``compile`` once the local
  elements on the device reach :data:`AUTO_COMPILE_MIN_ELEMS`, else ``eager``.

Threshold: one ES step regenerates the local noise about twice per member (perturb, then the
update's sum), 32 passes at the default population of 16. At 2**24 local elements a step costs
~14 s eager and ~3 s compiled, so the 20 s compile is repaid within the first two steps; below
~2**20 (the tiny test models) it would take a whole short run to repay, and eager starts at once.
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
    from esopt_mp.parallel.shard import ShardInfo

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


def resolve(backend: str, device, numel: int) -> str:
    """The concrete backend for ``numel`` local elements on ``device``; logs auto's choice once.

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
    elif numel >= AUTO_COMPILE_MIN_ELEMS:
        choice, why = "compile", f"{numel} local elements >= {AUTO_COMPILE_MIN_ELEMS} repay torch.compile"
    else:
        choice, why = "eager", f"{numel} local elements < {AUTO_COMPILE_MIN_ELEMS}: compiling would not repay"
    if (device.type, choice) not in _logged:
        _logged.add((device.type, choice))
        log.info("es.noise_backend=auto -> %s on %s (%s)", choice, device.type, why)
    return choice
