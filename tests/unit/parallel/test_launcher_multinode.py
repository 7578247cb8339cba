"""Launcher discovery for jobs that span nodes: per-node ranks and sizes, SLURM lists, mpirun's rendezvous."""
import sys
import types

import pytest

from esopt_mp.parallel import launcher
from esopt_mp.parallel.launcher import LaunchEnv, discover, first_slurm_host, slurm_tasks_on_node


def test_torchrun_second_node():
    """torchrun --nnodes 2 --node_rank 1 --nproc_per_node 1: global rank 1, local rank 0, one rank on the node."""
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1",
           "MASTER_ADDR": "node0", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "none"}
    le = discover(env)
    assert (le.rank, le.world_size, le.local_rank, le.local_world_size, le.master_addr, le.launcher) == (
        1, 2, 0, 1, "node0", "torchrun")


def test_deepspeed_no_ssh_second_node():
    """deepspeed --no_ssh --node_rank 1: its launch module sets LOCAL_SIZE (ranks on the node) and CROSS_RANK."""
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "CROSS_RANK": "1",
           "CROSS_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    le = discover(env)
    assert (le.rank, le.local_rank, le.local_world_size, le.launcher) == (3, 1, 2, "deepspeed")


def test_local_world_defaults_to_world_and_is_exported():
    le = LaunchEnv(1, 2, 1, "127.0.0.1", 29500, "env")
    assert le.local_world_size == 2
    env = {}
    LaunchEnv(1, 4, 0, "h", 1, "torchrun", 2).export(env)
    assert env == {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
                   "MASTER_PORT": "1"}


def test_bad_local_ranks_are_named():
    base = {"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "TORCHELASTIC_RUN_ID": "x"}
    with pytest.raises(RuntimeError, match="local rank 2 outside the 2 ranks on this node"):
        discover(dict(base, LOCAL_RANK="2", LOCAL_WORLD_SIZE="2"))
    with pytest.raises(RuntimeError, match=r"5 ranks on this node outside 1..4"):
        discover(dict(base, LOCAL_RANK="0", LOCAL_WORLD_SIZE="5"))
    with pytest.raises(RuntimeError, match="LOCAL_WORLD_SIZE='x' is not an integer"):
        discover(dict(base, LOCAL_WORLD_SIZE="x"))


def test_srun_two_nodes():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0", "SLURM_NODEID": "1",
           "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[03-04]", "MASTER_PORT": "21234"}
    le = discover(env)
    assert (le.rank, le.world_size, le.local_rank, le.local_world_size, le.master_addr, le.master_port) == (
        5, 8, 1, 4, "gpu03", 21234)
    # the batch script's export (scontrol show hostnames | head -n 1) wins over the node list
    assert discover(dict(env, MASTER_ADDR="gpu03.cluster")).master_addr == "gpu03.cluster"
    with pytest.raises(RuntimeError, match="SLURM_STEP_TASKS_PER_NODE='4 x2'"):
        discover(dict(env, SLURM_STEP_TASKS_PER_NODE="4 x2"))
    with pytest.raises(RuntimeError, match="SLURM_NODEID=2 outside the 2 nodes"):
        discover(dict(env, SLURM_NODEID="2"))


@pytest.mark.parametrize("counts,expect", [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3])])
def test_slurm_tasks_on_node(counts, expect):
    assert [slurm_tasks_on_node(counts, i) for i in range(len(expect))] == expect


@pytest.mark.parametrize("nodelist,first", [("rack[1-2]-n[01-04]", "rack1-n01"), ("gpu[03-05,7],cpu1", "gpu03"),
                                            ("a1,b[1-2]", "a1")])
def test_first_slurm_host_like_scontrol(nodelist, first):
    assert first_slurm_host(nodelist) == first


@pytest.mark.parametrize("bad", ["gpu[03", "a,,b", "", "gpu[]"])
def test_first_slurm_host_refuses_garbage(bad):
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        first_slurm_host(bad)


class _FakeMPI(types.ModuleType):
    """mpi4py.MPI as rank ``rank`` of a job whose rank 0 sends ``root``."""

    def __init__(self, rank, root):
        super().__init__("mpi4py.MPI")
        self.calls, self.finalized, self._root = [], False, root
        self.COMM_WORLD = types.SimpleNamespace(Get_rank=lambda: rank, bcast=self._bcast)

    def _bcast(self, obj, root=0):
        self.calls.append(obj)
        return obj if self.COMM_WORLD.Get_rank() == root else self._root

    def Is_finalized(self):
        return self.finalized

    def Finalize(self):
        self.finalized = True


def _with_mpi(monkeypatch, mpi):
    pkg = types.ModuleType("mpi4py")
    pkg.MPI = mpi
    monkeypatch.setitem(sys.modules, "mpi4py", pkg)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    monkeypatch.setattr(launcher, "_MPI_RENDEZVOUS", None)


OMPI_NODE1 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
              "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}


def test_mpirun_across_nodes_takes_rank0s_address_and_port(monkeypatch):
    """A rank whose node has its own MASTER_ADDR/PORT still joins the broadcast and uses rank 0's values."""
    mpi = _FakeMPI(1, ("head0", 29555))
    _with_mpi(monkeypatch, mpi)
    le = discover(dict(OMPI_NODE1, MASTER_ADDR="elsewhere", MASTER_PORT="1"))
    assert (le.rank, le.local_rank, le.local_world_size, le.master_addr, le.master_port) == (1, 0, 1, "head0", 29555)
    assert mpi.calls == [None] and mpi.finalized
    assert discover(OMPI_NODE1).master_addr == "head0" and len(mpi.calls) == 1  # cached: MPI is finalised


def test_mpirun_rank0_sends_its_host_name(monkeypatch):
    mpi = _FakeMPI(0, None)
    _with_mpi(monkeypatch, mpi)
    monkeypatch.setattr(launcher.socket, "gethostname", lambda: "node-a")
    env = dict(OMPI_NODE1, OMPI_COMM_WORLD_RANK="0")
    assert (discover(env).master_addr, discover(env).master_port) == ("node-a", launcher.DEFAULT_PORT)
    assert mpi.calls == [("node-a", launcher.DEFAULT_PORT)]
    pmi = {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "MASTER_PORT": "2222"}
    _with_mpi(monkeypatch, mpi := _FakeMPI(0, None))
    le = discover(pmi)
    assert (le.master_addr, le.master_port, le.local_world_size) == ("node-a", 2222, 2)


def test_mpirun_across_nodes_without_mpi4py(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import fails
    monkeypatch.setattr(launcher, "_MPI_RENDEZVOUS", None)
    with pytest.raises(RuntimeError, match=r"MASTER_ADDR exported .* or mpi4py installed"):
        discover(OMPI_NODE1)
    le = discover(dict(OMPI_NODE1, MASTER_ADDR="head", MASTER_PORT="3333"))
    assert (le.master_addr, le.master_port) == ("head", 3333)
    # one node: nothing to discover, MPI never touched
    one = dict(OMPI_NODE1, OMPI_COMM_WORLD_LOCAL_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="1")
    assert discover(one).master_addr == "127.0.0.1"
