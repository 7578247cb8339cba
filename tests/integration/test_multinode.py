"""Two "nodes" on this host: two launcher invocations with distinct node ranks and one rendezvous.

Each runs the same short ES config as a single-node ``torchrun --nproc_per_node 2`` reference and must end
with bitwise identical fp32 weights (the HF exports are compared tensor by tensor). The run directory is
shared, as ESOPT_RUNS on a cluster's shared file system. ESOPT_THREADS=1 keeps the per-rank thread count
equal between layouts (it follows the ranks on a node otherwise, and matmul sums depend on it).
"""
import glob
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from esopt_mp.parallel.local_world import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = ["model=tiny", "objective=target_logprob", "es.population=4", "es.steps=2", "objective.batch=2",
       "parallel.dp=2", "run.export=true"]
_OUTER = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")  # none leak in
ENV = dict({k: v for k, v in os.environ.items() if k not in _OUTER}, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", ESOPT_THREADS="1", DS_ACCELERATOR="cpu",
           TORCH_EXTENSIONS_DIR=os.path.join(ROOT, ".cache", "torch_extensions"))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _launch(cmds, run_dir, timeout=300):
    """Start every command at once (one per node), wait for all; rank 0's JSON summary and everyone's stderr."""
    procs = [subprocess.Popen(c + [f"run.dir={run_dir}"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c in cmds]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"{p.args[:8]}...\n{err[-4000:]}"
    # rank 0 prints the summary; under c10d the rendezvous decides which invocation holds it
    found = [json.loads(l) for out, _ in outs for l in out.splitlines() if l.startswith('{"')]
    found = [d for d in found if "steps" in d]
    assert len(found) == 1, found
    return found[0], "".join(err for _, err in outs)


def _weights(run_dir):
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(run_dir, "export", "*.safetensors")))
    assert files, f"no export in {run_dir}"
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single node, two ranks: the weights every two-node launch must reproduce."""
    run = tmp_path_factory.mktemp("single") / "run"
    s, _ = _launch([TORCHRUN + ["--nproc_per_node", "2", "--master_port", str(free_port()), "launch/train.py", *CFG]],
                   run)
    assert s["steps"] == 2
    ref = _weights(str(run))
    base = _weights_of_base(str(run))
    assert any(not torch.equal(ref[k], base[k]) for k in base), "ES left every weight unchanged: nothing compared"
    return ref


def _weights_of_base(run_dir):
    from safetensors.torch import load_file

    with open(os.path.join(run_dir, "config.json")) as f:
        base = json.load(f)["base_model"]
    out = {}
    for f in glob.glob(os.path.join(base, "*.safetensors")):
        out.update(load_file(f))
    return out


def _assert_same(ref, got):
    assert sorted(got) == sorted(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype == torch.float32, k
        assert torch.equal(got[k], v), f"{k}: max |diff| {(got[k] - v).abs().max().item():.3g}"


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_torchrun_two_nodes(reference, tmp_path, rdzv):
    """static: each node told its --node_rank and node 0's address; c10d: the same line on both nodes, node ranks
    handed out by the rendezvous (the store's host found by trying, as two agents on one host do)."""
    port = str(free_port())
    if rdzv == "static":
        nodes = [["--node_rank", str(r), "--master_addr", "127.0.0.1", "--master_port", port] for r in (0, 1)]
    else:
        nodes = [["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes"]] * 2
    cmds = [TORCHRUN + ["--nnodes", "2", "--nproc_per_node", "1", *n, "launch/train.py", *CFG] for n in nodes]
    s, err = _launch(cmds, tmp_path / "run")
    assert s["steps"] == 2 and s["comm_bytes_per_step"] > 0
    assert "rank 0/2 (torchrun, 1 on this node, rendezvous " in err
    _assert_same(reference, _weights(str(tmp_path / "run")))


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed (extra [deepspeed])")
def test_deepspeed_two_nodes_without_ssh(reference, tmp_path):
    """deepspeed --no_ssh: one invocation per node, each told its --node_rank; the hostfile only counts slots."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port = str(free_port())
    nodes = [[sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
              "--node_rank", str(r), "--master_addr", "127.0.0.1", "--master_port", port, "launch/train.py",
              "parallel.launcher=deepspeed", *CFG] for r in (0, 1)]
    s, err = _launch(nodes, tmp_path / "run")
    assert s["steps"] == 2 and s["comm_bytes_per_step"] > 0
    assert "rank 0/2 (deepspeed, 1 on this node, rendezvous 127.0.0.1:" in err
    _assert_same(reference, _weights(str(tmp_path / "run")))


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI not installed")
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py not installed (extra [mpi])")
def test_mpirun_two_nodes_mpi4py_rendezvous(reference, tmp_path):
    """One ``mpirun -np 2`` whose ranks each see themselves alone on their node (Open MPI's per-node variables
    overridden per rank): two mpirun invocations are two MPI jobs and cannot share a world. No MASTER_ADDR is
    given, so the address can only come from rank 0 over MPI."""
    env_node = ["env", "OMPI_COMM_WORLD_LOCAL_RANK=0", "OMPI_COMM_WORLD_LOCAL_SIZE=1"]
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", f"MASTER_PORT={free_port()}",
           *env_node, sys.executable, "launch/train.py", *CFG]
    s, err = _launch([cmd], tmp_path / "run")
    assert s["steps"] == 2 and s["comm_bytes_per_step"] > 0
    assert f"rank 0/2 (mpirun, 1 on this node, rendezvous {socket.gethostname()}:" in err
    _assert_same(reference, _weights(str(tmp_path / "run")))


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI not installed")
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py not installed (extra [mpi])")
def test_mpirun_nodes_with_different_environments_agree(tmp_path):
    """mpirun forwards its shell's variables to the ranks on its own node only: rank 0's "node" has MASTER_ADDR and
    MASTER_PORT, rank 1's has neither. Both must end up with rank 0's values (a rank that skipped the broadcast
    used to leave the other waiting in it)."""
    script = tmp_path / "node.sh"
    script.write_text(
        'if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then export MASTER_ADDR=127.0.0.1 MASTER_PORT=23456; fi\n'
        "export OMPI_COMM_WORLD_LOCAL_RANK=0 OMPI_COMM_WORLD_LOCAL_SIZE=1\n"
        f'exec {sys.executable} -c "from esopt_mp.parallel import discover; le = discover(); '
        'open(f\'rdzv{le.rank}.txt\', \'w\').write(\' \'.join(map(str, (le.rank, le.local_world_size, '
        'le.master_addr, le.master_port))))"\n')  # one file per rank: mpirun interleaves the ranks' stdout
    env = dict(ENV, PYTHONPATH=ROOT)
    proc = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "sh", str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = sorted((tmp_path / f"rdzv{r}.txt").read_text().split() for r in range(2))
    assert got == [["0", "1", "127.0.0.1", "23456"], ["1", "1", "127.0.0.1", "23456"]]
