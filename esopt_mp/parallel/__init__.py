"""Topology (ParallelDims), launcher discovery and the one place collectives run (Collectives)."""
from esopt_mp.parallel.collectives import Collectives, CommStats
from esopt_mp.parallel.comm import ReplicaDriftError, check_replicas, gather_returns, shard_checksum
from esopt_mp.parallel.dims import ParallelDims, close_distributed, init_distributed
from esopt_mp.parallel.grads import average_grads, global_grad_norm
from esopt_mp.parallel.launcher import LaunchEnv, discover, first_slurm_host

__all__ = ["Collectives", "CommStats", "LaunchEnv", "ParallelDims", "ReplicaDriftError", "average_grads", "check_replicas",
           "close_distributed", "discover", "first_slurm_host", "gather_returns", "global_grad_norm", "init_distributed",
           "shard_checksum"]
