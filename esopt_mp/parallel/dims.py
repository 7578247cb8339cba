"""ParallelDims: the dp x tp grid of an ES job, passed explicitly (no process-group globals).

Ranks are laid out row-major over (dp, tp): the ``tp`` ranks of one data-parallel
group are consecutive, so tensor parallelism stays inside a node. Each dp group
evaluates its own members; its TP leader (tp rank 0) owns prompts, environments
and the returns it reports.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging

import torch
import torch.distributed as dist

from esopt_mp.parallel.config import BACKENDS, check_layout, check_timeout
from esopt_mp.parallel.launcher import LaunchEnv
from esopt_mp.typed import check_choice

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ParallelDims:
    dp: int
    tp: int
    world_size: int
    rank: int = 0
    device_type: str = "cpu"
    mesh: object = dataclasses.field(default=None, repr=False)  # DeviceMesh ("dp", "tp") when world > 1
    backend: str = "gloo"  # of the process group: decides where collectives take their tensors
    timeout_s: float = 1800.0  # parallel.timeout_s: bounds every collective, the checkpoint group's too
    _comm: object = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _ckpt_group: object = dataclasses.field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        check_layout(self.dp, self.tp, self.world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of size {self.world_size}")

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_tp_leader(self) -> bool:
        return self.tp_rank == 0

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def tp_mesh(self):
        return self.mesh["tp"] if self.mesh is not None else None

    @property
    def comm_device(self) -> torch.device:
        """Where this backend takes tensors: this rank's CUDA device for NCCL, the host for gloo."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def comm(self):
        """This process's :class:`~esopt_mp.parallel.collectives.Collectives` (built once)."""
        if self._comm is None:
            from esopt_mp.parallel.collectives import Collectives

            self._comm = Collectives(self)
        return self._comm

    def group(self, dim: str):
        """Process group of ``dim`` in {"dp", "tp", "world"}; None when not distributed."""
        if self.mesh is None:
            return None
        return dist.group.WORLD if dim == "world" else self.mesh.get_group(dim)

    def checkpoint_group(self):
        """Gloo group of dp group 0's tp ranks (the checkpoint writers), or None where one rank writes or none.

        Made on the first call, which every rank must make at the same point
        (``new_group`` is collective). Gloo and separate from the training
        groups because torch.distributed.checkpoint exchanges its plans from
        the asynchronous save's thread, with pickled objects on the host, while
        training collectives go on.
        """
        if self._ckpt_group is False:
            group = None
            if self.mesh is not None and self.tp > 1:
                group = dist.new_group(ranks=list(range(self.tp)), backend="gloo",
                                       timeout=datetime.timedelta(seconds=self.timeout_s))
            self._ckpt_group = group if self.dp_rank == 0 else None
        return self._ckpt_group

    def members(self, population: int) -> list[int]:
        """Members this rank's dp group evaluates: m with m % dp == dp_rank."""
        return list(range(self.dp_rank, population, self.dp))

    def build_mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        if self.world_size > 1:
            self.mesh = init_device_mesh(self.device_type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
        return self.mesh


def _skip_deepspeed_shm_op() -> None:
    """On CPU, DeepSpeed's communication backend JIT-compiles its shared-memory all-reduce op (g++, minutes on a
    fresh node) before the group exists. ES's collectives are torch.distributed's and move a few bytes a step:
    marking the op incompatible for this process skips the build. (A process group DeepSpeed creates elsewhere,
    e.g. ``deepspeed.initialize``, builds it as before.)"""
    try:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # probed once per process, on first use
    except (ImportError, AttributeError, TypeError):  # another DeepSpeed layout: it builds the op as before
        pass


def init_distributed(le: LaunchEnv, dp: int, tp: int, *, backend: str = "auto", use_deepspeed: bool = False,
                     timeout_s: float = 1800.0) -> ParallelDims:
    """Create the process group (if world > 1) and the (dp, tp) mesh.

    ``backend="auto"`` is NCCL on CUDA and gloo on CPU. With ``use_deepspeed``
    the group is created by ``deepspeed.init_distributed`` (its MPI discovery
    included), as under the ``deepspeed`` launcher.
    """
    dims = ParallelDims(dp, tp, le.world_size, le.rank)  # validates before any process group exists
    cuda = torch.cuda.is_available()
    dims.device_type = "cuda" if cuda else "cpu"
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    check_choice(backend, BACKENDS, "parallel.backend")
    if backend == "nccl" and not cuda:
        raise ValueError("parallel.backend=nccl needs CUDA, and torch.cuda.is_available() is False")
    check_timeout(timeout_s)
    dims.backend, dims.timeout_s = backend, timeout_s
    if cuda:
        torch.cuda.set_device(le.local_rank % torch.cuda.device_count())
    if le.world_size > 1 and not dist.is_initialized():
        le.export()
        if use_deepspeed:
            import deepspeed

            if not cuda:
                _skip_deepspeed_shm_op()
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=True,
                                       timeout=datetime.timedelta(seconds=timeout_s))
        else:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    if dist.is_initialized():
        dims.backend = dist.get_backend()  # an existing group (or deepspeed's) decides
    dims.build_mesh()
    log.info("rank %d/%d (%s, %d on this node, rendezvous %s:%d): dp_rank %d of %d, tp_rank %d of %d, backend %s",
             le.rank, le.world_size, le.launcher, le.local_world_size, le.master_addr, le.master_port, dims.dp_rank,
             dp, dims.tp_rank, tp, backend if le.world_size > 1 else "none")
    return dims


def close_distributed(drain: bool = False, drained=None, keep: bool = False) -> bool:
    """Tear the process group down; ``drain``: first meet every rank at a barrier, then call ``drained()`` (every
    rank got there: whatever follows is teardown).

    Ranks that all succeeded drain so none closes its connections while a peer is still finishing the last
    collective (gloo aborts in its destructor then). A failed rank must not drain: its peers may never come.

    ``keep`` (with ``drain``): once every rank has met, the groups are not destroyed but left to the process's
    end, and True is returned: the caller must then end the process without the interpreter's teardown (which
    would destroy them), as ``launch/train.py`` does. Even after the barrier, gloo can abort a rank in its
    destructor when a peer has closed its sockets first (a finished run's rank killed by SIGABRT: exit -6, not
    its code, and a stopped run not requeued); the process's end (``exit_keeping_groups``) closes them without a
    destructor.
    """
    if dist.is_initialized():
        if drain:
            dist.barrier()
            if drained is not None:
                drained()
            if keep:
                return True
        dist.destroy_process_group()
    return False


def exit_keeping_groups(code: int) -> None:
    """End the process as ``sys.exit(code)`` would, less the interpreter's teardown (which would destroy the
    process groups ``close_distributed(keep=True)`` left open): non-daemon threads are joined and queued executor
    work finishes (from the main thread, as the interpreter does first), the exit handlers run (logging's, the
    trackers', coverage's, a plugin's) and the standard streams are flushed. Object finalizers (``__del__``) do
    not run, and a file a plugin left open unclosed is not flushed: close what must reach the disk."""
    import atexit
    import os
    import sys
    import threading

    if threading.current_thread() is threading.main_thread():
        threading._shutdown()  # what the interpreter's exit does before the exit handlers
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe whose reader is gone
            pass
    os._exit(code)
