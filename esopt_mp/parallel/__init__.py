"""Topology (ParallelDims), launcher discovery and the few collectives ES needs."""
from esopt_mp.parallel.comm import CommStats, ReplicaDriftError, check_replicas, gather_returns, shard_checksum
from esopt_mp.parallel.dims import ParallelDims, close_distributed, init_distributed
from esopt_mp.parallel.launcher import LaunchEnv, discover, first_slurm_host

__all__ = ["CommStats", "LaunchEnv", "ParallelDims", "ReplicaDriftError", "check_replicas", "close_distributed",
           "discover", "first_slurm_host", "gather_returns", "init_distributed", "shard_checksum"]
