"""Topology (ParallelDims), launcher discovery and the one place collectives run (Collectives)."""
from esopt_mp.parallel.collectives import Collectives, CommStats
from esopt_mp.parallel.comm import ReplicaDriftError, check_replicas, gather_returns, shard_checksum
from esopt_mp.parallel.dims import ParallelDims, close_distributed, init_distributed
from esopt_mp.parallel.launcher import LaunchEnv, discover, first_slurm_host

__all__ = ["Collectives", "CommStats", "LaunchEnv", "ParallelDims", "ReplicaDriftError", "check_replicas",
           "close_distributed", "discover", "first_slurm_host", "gather_returns", "init_distributed",
           "shard_checksum"]
