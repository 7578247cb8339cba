"""Topology (ParallelDims), launcher discovery and the one place collectives run (Collectives).

The names below load on first use (PEP 562), so importing ``esopt_mp.parallel.config`` loads no torch.
"""
import importlib

_EXPORTS = {
    "Collectives": "collectives", "CommStats": "collectives", "ReplicaDriftError": "comm", "check_replicas": "comm",
    "gather_returns": "comm", "shard_checksum": "comm", "ParallelDims": "dims", "close_distributed": "dims",
    "init_distributed": "dims", "average_grads": "grads", "global_grad_norm": "grads", "LaunchEnv": "launcher",
    "discover": "launcher", "first_slurm_host": "launcher",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
