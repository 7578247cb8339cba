"""Turn a launcher's environment into (rank, world, local rank, master address).

One function for every way a job is started: plain ``python`` (world 1),
``torchrun``, the ``deepspeed`` launcher, SLURM ``srun`` and ``mpirun`` (Open
MPI or MPICH/PMI). Missing pieces raise an error that names the variable.
"""
from __future__ import annotations

import dataclasses
import os
import re
import socket
from collections.abc import Mapping

DEFAULT_PORT = 29500


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str

    def export(self, environ=None) -> None:
        """Write the torch.distributed ``env://`` variables (idempotent)."""
        env = os.environ if environ is None else environ
        env.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank),
                   MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port))


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``gpu[03-05,7],cpu1`` -> ``gpu03``."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m or not m.group(1):
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = m.group(1), m.group(3)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _int(env: Mapping[str, str], key: str, launcher: str, default: int | None = None) -> int:
    value = env.get(key)
    if value is None:
        if default is not None:
            return default
        raise RuntimeError(f"{launcher} launch detected but {key} is not set")
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"{key}={value!r} is not an integer") from None


def _port(env: Mapping[str, str]) -> int:
    return _int(env, "MASTER_PORT", "", DEFAULT_PORT)


def _mpi_master(env: Mapping[str, str], world: int, local_size: int) -> str:
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if local_size == world:
        return "127.0.0.1"
    try:  # one broadcast of rank 0's host name
        from mpi4py import MPI

        return MPI.COMM_WORLD.bcast(socket.gethostname() if MPI.COMM_WORLD.Get_rank() == 0 else None, root=0)
    except ImportError:
        raise RuntimeError(
            "mpirun across nodes needs MASTER_ADDR exported (mpirun -x MASTER_ADDR=host) or mpi4py installed "
            "(pip install esopt_mp[mpi])"
        ) from None


def discover(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Rank / world / local rank / master address of this process, from its environment."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:  # torchrun, deepspeed, or exported by hand
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "deepspeed" if "LOCAL_SIZE" in env else "env"
        for key in ("RANK", "WORLD_SIZE"):
            if key not in env:
                raise RuntimeError(f"{launcher} environment has {'WORLD_SIZE' if key == 'RANK' else 'RANK'} "
                                   f"but not {key}; both are needed")
        rank, world = _int(env, "RANK", launcher), _int(env, "WORLD_SIZE", launcher)
        if world > 1 and not env.get("MASTER_ADDR"):
            raise RuntimeError(f"{launcher} launch with WORLD_SIZE={world} but MASTER_ADDR is not set")
        return _checked(LaunchEnv(rank, world, _int(env, "LOCAL_RANK", launcher, 0),
                                  env.get("MASTER_ADDR", "127.0.0.1"), _port(env), launcher))
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):  # inside srun
        world = _int(env, "SLURM_NTASKS", "srun")
        if env.get("MASTER_ADDR"):
            master = env["MASTER_ADDR"]
        elif env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"):
            master = first_slurm_host(env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"])
        else:
            raise RuntimeError("srun launch detected but neither MASTER_ADDR nor SLURM_JOB_NODELIST is set")
        return _checked(LaunchEnv(_int(env, "SLURM_PROCID", "srun"), world, _int(env, "SLURM_LOCALID", "srun"),
                                  master, _port(env), "srun"))
    if "OMPI_COMM_WORLD_RANK" in env:
        world = _int(env, "OMPI_COMM_WORLD_SIZE", "mpirun (Open MPI)")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "mpirun (Open MPI)")
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun (Open MPI)", world)
        return _checked(LaunchEnv(_int(env, "OMPI_COMM_WORLD_RANK", "mpirun"), world, local,
                                  _mpi_master(env, world, local_size), _port(env), "mpirun"))
    if "PMI_RANK" in env:
        world = _int(env, "PMI_SIZE", "mpirun (PMI)")
        local = _int(env, "MPI_LOCALRANKID", "mpirun (PMI)", _int(env, "PMI_LOCAL_RANK", "mpirun (PMI)", 0))
        local_size = _int(env, "MPI_LOCALNRANKS", "mpirun (PMI)", world)
        return _checked(LaunchEnv(_int(env, "PMI_RANK", "mpirun"), world, local,
                                  _mpi_master(env, world, local_size), _port(env), "mpirun"))
    return LaunchEnv(0, 1, 0, "127.0.0.1", _port(env), "python")


def _checked(le: LaunchEnv) -> LaunchEnv:
    if le.world_size < 1:
        raise RuntimeError(f"world size must be >= 1, got {le.world_size}")
    if not 0 <= le.rank < le.world_size:
        raise RuntimeError(f"rank {le.rank} outside world of size {le.world_size}")
    if le.local_rank < 0:
        raise RuntimeError(f"local rank must be >= 0, got {le.local_rank}")
    return le
