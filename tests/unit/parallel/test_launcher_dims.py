import pytest

from esopt_mp.parallel import ParallelDims, discover, first_slurm_host


def test_plain_python_is_world_one():
    le = discover({})
    assert (le.rank, le.world_size, le.local_rank, le.launcher) == (0, 1, 0, "python")


def test_torchrun_and_deepspeed():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234",
           "TORCHELASTIC_RUN_ID": "x"}
    le = discover(env)
    assert (le.rank, le.world_size, le.local_rank, le.master_addr, le.master_port, le.launcher) == (
        3, 4, 1, "10.0.0.1", 1234, "torchrun")
    ds = dict(env, LOCAL_SIZE="2")
    del ds["TORCHELASTIC_RUN_ID"]
    assert discover(ds).launcher == "deepspeed"


def test_missing_pieces_are_named():
    with pytest.raises(RuntimeError, match="WORLD_SIZE"):
        discover({"RANK": "0"})
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        discover({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(RuntimeError, match="rank 5 outside"):
        discover({"RANK": "5", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})
    with pytest.raises(RuntimeError, match="SLURM_NTASKS"):
        discover({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0"})
    with pytest.raises(RuntimeError, match="SLURM_JOB_NODELIST"):
        discover({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"})
    with pytest.raises(RuntimeError, match="OMPI_COMM_WORLD_SIZE"):
        discover({"OMPI_COMM_WORLD_RANK": "0"})
    with pytest.raises(RuntimeError, match="not an integer"):
        discover({"RANK": "a", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})


def test_srun():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
           "SLURM_JOB_NODELIST": "gpu[03-04,7]"}
    le = discover(env)
    assert (le.rank, le.world_size, le.local_rank, le.master_addr, le.launcher) == (5, 8, 1, "gpu03", "srun")
    # the batch script itself (no step id) is not an srun task
    assert discover({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}).launcher == "python"


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("a[1-3]", "a1"), ("gpu[007,9]", "gpu007"),
                                            ("x-y[10-11],z[1]", "x-y10"), ("h1,h2", "h1")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_mpirun_open_mpi_and_pmi():
    ompi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    le = discover(ompi)
    assert (le.rank, le.world_size, le.local_rank, le.master_addr, le.launcher) == (1, 2, 1, "127.0.0.1", "mpirun")
    assert discover(dict(ompi, MASTER_ADDR="head")).master_addr == "head"
    pmi = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4"}
    le = discover(pmi)
    assert (le.rank, le.world_size, le.local_rank, le.master_addr) == (2, 4, 0, "127.0.0.1")


def test_parallel_dims_validation_and_layout():
    with pytest.raises(ValueError, match=r"parallel.dp \* parallel.tp must equal the world size: 2 \* 2 = 4 != 3"):
        ParallelDims(2, 2, 3)
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        ParallelDims(0, 1, 0)
    d = ParallelDims(2, 2, 4, rank=3)
    assert (d.dp_rank, d.tp_rank, d.is_tp_leader) == (1, 1, False)
    assert d.members(7) == [1, 3, 5]
    assert ParallelDims(2, 2, 4, rank=2).is_tp_leader
