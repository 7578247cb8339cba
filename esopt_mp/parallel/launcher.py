"""Turn a launcher's environment into (rank, world, local rank, master address).

One function for every way a job is started: plain ``python`` (world 1),
``torchrun``, the ``deepspeed`` launcher, SLURM ``srun`` and ``mpirun`` (Open
MPI or MPICH/PMI), on one node or many. Missing pieces raise an error that
names the variable.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
from collections.abc import Mapping

DEFAULT_PORT = 29500
log = logging.getLogger(__name__)
_MPI_RENDEZVOUS: tuple[str, int] | None = None  # one MPI broadcast per process (MPI cannot be re-initialised)


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str
    local_world_size: int = 0  # ranks on this node; 0: unknown, taken as world_size (every rank on this node)

    def __post_init__(self):
        if self.local_world_size == 0:
            object.__setattr__(self, "local_world_size", self.world_size)

    def export(self, environ=None) -> None:
        """Write the torch.distributed ``env://`` variables (idempotent)."""
        env = os.environ if environ is None else environ
        env.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank),
                   LOCAL_WORLD_SIZE=str(self.local_world_size), MASTER_ADDR=self.master_addr,
                   MASTER_PORT=str(self.master_port))


def _first_of_brackets(host: str) -> str:
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], host)


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list, as ``scontrol show hostnames | head -1``:
    ``gpu[03-05,7],cpu1`` -> ``gpu03``, ``rack[1-2]-n[01-04]`` -> ``rack1-n01``."""
    host = r"(?:[^,\[\]\s]|\[[^\[\]]+\])+"
    if not re.fullmatch(rf"{host}(?:,{host})*", nodelist.strip()):
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    return _first_of_brackets(re.match(host, nodelist.strip()).group(0))


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node ``node_id`` from SLURM's compressed count list: ``2(x3),1`` -> 2, 2, 2, 1."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise RuntimeError(f"cannot parse SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise RuntimeError(f"SLURM_NODEID={node_id} outside the {len(counts)} nodes of {tasks_per_node!r}")
    return counts[node_id]


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


def _mpi_rendezvous(env: Mapping[str, str], world: int, local_size: int) -> tuple[str, int]:
    """Master address and port of an ``mpirun`` job.

    On one node: ``MASTER_ADDR`` or loopback. Across nodes every rank takes rank
    0's ``MASTER_ADDR`` (else its host name) and ``MASTER_PORT`` from one mpi4py
    broadcast: mpirun forwards the local environment to the ranks on its own node
    only, so a value read on each rank can differ between nodes (and a rank that
    skipped the broadcast would leave the others waiting in it). MPI is finalised
    right after, so the run itself never depends on it.
    """
    global _MPI_RENDEZVOUS
    if local_size == world:
        return env.get("MASTER_ADDR") or "127.0.0.1", _port(env)
    if _MPI_RENDEZVOUS is not None:
        return _MPI_RENDEZVOUS
    try:
        from mpi4py import MPI
    except ImportError:
        if env.get("MASTER_ADDR"):  # mpirun -x MASTER_ADDR=host [-x MASTER_PORT=p]: the same on every rank
            return env["MASTER_ADDR"], _port(env)
        raise RuntimeError(
            "mpirun across nodes needs MASTER_ADDR exported (mpirun -x MASTER_ADDR=host) or mpi4py installed "
            "(pip install esopt_mp[mpi])"
        ) from None
    comm = MPI.COMM_WORLD
    mine = (env.get("MASTER_ADDR") or socket.gethostname(), _port(env)) if comm.Get_rank() == 0 else None
    addr, port = comm.bcast(mine, root=0)
    if not MPI.Is_finalized():
        MPI.Finalize()
    _MPI_RENDEZVOUS = (addr, port)
    log.info("mpirun across nodes (%d of %d ranks on this node): rendezvous %s:%d from rank 0 over MPI",
             local_size, world, addr, port)
    return addr, port


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
        # torchrun: LOCAL_WORLD_SIZE; deepspeed's launch: LOCAL_SIZE
        local_size = _int(env, "LOCAL_WORLD_SIZE", launcher, _int(env, "LOCAL_SIZE", launcher, 0))
        return _checked(LaunchEnv(rank, world, _int(env, "LOCAL_RANK", launcher, 0),
                                  env.get("MASTER_ADDR", "127.0.0.1"), _port(env), launcher, local_size))
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):  # inside srun
        world = _int(env, "SLURM_NTASKS", "srun")
        if env.get("MASTER_ADDR"):
            master = env["MASTER_ADDR"]
        elif env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"):
            master = first_slurm_host(env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"])
        else:
            raise RuntimeError("srun launch detected but neither MASTER_ADDR nor SLURM_JOB_NODELIST is set")
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        local_size = slurm_tasks_on_node(per_node, _int(env, "SLURM_NODEID", "srun", 0)) if per_node else 0
        return _checked(LaunchEnv(_int(env, "SLURM_PROCID", "srun"), world, _int(env, "SLURM_LOCALID", "srun"),
                                  master, _port(env), "srun", local_size))
    if "OMPI_COMM_WORLD_RANK" in env:
        world = _int(env, "OMPI_COMM_WORLD_SIZE", "mpirun (Open MPI)")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "mpirun (Open MPI)")
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun (Open MPI)", world)
        return _checked(LaunchEnv(_int(env, "OMPI_COMM_WORLD_RANK", "mpirun"), world, local,
                                  *_mpi_rendezvous(env, world, local_size), "mpirun", local_size))
    if "PMI_RANK" in env:
        world = _int(env, "PMI_SIZE", "mpirun (PMI)")
        local = _int(env, "MPI_LOCALRANKID", "mpirun (PMI)", _int(env, "PMI_LOCAL_RANK", "mpirun (PMI)", 0))
        local_size = _int(env, "MPI_LOCALNRANKS", "mpirun (PMI)", world)
        return _checked(LaunchEnv(_int(env, "PMI_RANK", "mpirun"), world, local,
                                  *_mpi_rendezvous(env, world, local_size), "mpirun", local_size))
    return LaunchEnv(0, 1, 0, "127.0.0.1", _port(env), "python")


def _checked(le: LaunchEnv) -> LaunchEnv:
    if le.world_size < 1:
        raise RuntimeError(f"world size must be >= 1, got {le.world_size}")
    if not 0 <= le.rank < le.world_size:
        raise RuntimeError(f"rank {le.rank} outside world of size {le.world_size}")
    if not 1 <= le.local_world_size <= le.world_size:
        raise RuntimeError(f"{le.launcher}: {le.local_world_size} ranks on this node outside 1..{le.world_size} "
                           "(the world size)")
    if not 0 <= le.local_rank < le.local_world_size:
        raise RuntimeError(f"{le.launcher}: local rank {le.local_rank} outside the {le.local_world_size} ranks "
                           "on this node")
    return le


def cpu_threads(local_world_size: int, environ: Mapping[str, str] | None = None,
                cores: int | None = None) -> tuple[int, str]:
    """``(threads, why)`` for torch's intra-op pool on a CPU rank: ``ESOPT_THREADS``, else the user's
    ``OMP_NUM_THREADS``, else this node's cores split over its ranks. torchrun sets ``OMP_NUM_THREADS=1`` where
    the user left it unset, so that value is honoured too and the log says how to ask for more."""
    env = os.environ if environ is None else environ
    cores = cores or os.cpu_count() or 1
    for var in ("ESOPT_THREADS", "OMP_NUM_THREADS"):
        value = env.get(var, "").strip()
        if value:
            try:
                n = int(value)
            except ValueError:
                raise RuntimeError(f"{var}={value!r}: expected a number of threads >= 1") from None
            if n < 1:
                raise RuntimeError(f"{var}={value!r}: expected a number of threads >= 1")
            return n, var
    return max(1, cores // max(1, local_world_size)), f"{cores} cores / {local_world_size} rank(s) on this node"
