"""Topology (ParallelDims), launcher discovery and the one place collectives run (Collectives).

The names below load on first use (PEP 562), so importing ``esopt_mp.parallel.config`` loads no torch.
"""
from esopt_mp.lazy import lazy_exports

_EXPORTS = {
    "Collectives": "collectives", "CommStats": "collectives", "ReplicaDriftError": "collectives",
    "check_replicas": "collectives", "first_failure": "collectives", "gather_returns": "collectives",
    "shard_checksum": "collectives", "ParallelDims": "dims", "close_distributed": "dims",
    "exit_keeping_groups": "dims",
    "init_distributed": "dims", "average_grads": "grads", "global_grad_norm": "grads", "LaunchEnv": "launcher",
    "MemberQueue": "member_queue",
    "cpu_threads": "launcher", "discover": "launcher", "first_slurm_host": "launcher",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
