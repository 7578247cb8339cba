"""The entry point under every launcher, as a user runs it (subprocesses)."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from tools.local_world import free_port

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = ["model=tiny", "objective=target_logprob", "es.population=4", "es.steps=2", "objective.batch=2"]
AGENT_SHORT = ["es.population=4", "es.steps=2", "env.episodes_per_step=2", "env.n_eval=4", "env.max_turns=2",
               "run.eval_every=0"]


def _run(cmd, run_dir, env=None, timeout=600):
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.run(cmd + [f"run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=full_env)
    return proc


def _summary(proc):
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    return json.loads(lines[-1])


def test_plain_python(tmp_path):
    proc = _run([sys.executable, "launch/train.py", *SHORT], tmp_path / "run")
    s = _summary(proc)
    assert s["steps"] == 2 and s["comm_bytes_per_step"] == 0
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "return_mean" in r] == [0, 1]
    assert sum("eval" in r for r in rows) == 2 and "summary" in rows[-1]
    assert len((tmp_path / "run" / "history.jsonl").read_text().splitlines()) == 2
    assert (tmp_path / "run" / "training.png").stat().st_size > 10_000
    assert any((tmp_path / "run" / "tensorboard").iterdir())  # event file
    assert "held-out score" in proc.stderr and "ES comm / step" in proc.stderr  # the summary screen


def test_torchrun_tp2_dp2_agent_default(tmp_path):
    """The embedded default (tiny agent, Sudoku episodes) sharded tp=2 inside each of 2 dp groups."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port()),
           "launch/train.py", "parallel.tp=2", "parallel.dp=2", "parallel.checksum_every=1", *AGENT_SHORT]
    s = _summary(_run(cmd, tmp_path / "run"))
    # O(G + turns) bytes counted at our collectives (returns, stop flag, checksums, TP channel), never
    # O(parameters): a gradient all-reduce of this rank's shard would be 4 * params_local bytes
    assert s["steps"] == 2 and 0 < s["comm_bytes_per_step"] < 64 * 1024 < 4 * s["params_local"] // 10
    rows = [json.loads(l) for l in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert {r["member"] for r in train} == {0, 2}  # dp group 0's members; rank 0 writes its own group's episodes
    assert all(r["turns"] and r["ended"] in ("terminated", "truncated", "turn_budget") for r in rows)


@pytest.mark.parametrize("override,line", [
    ("parallel.tp=3", "error: parallel: parallel.dp * parallel.tp must equal the world size: 1 * 3 = 3 != 1"),
    ("env.gem=1", "error: env.gem=1: an environment's section takes keys, env.gem.<key>=value")],
    ids=["validated_config", "env_section"])
def test_bad_config_fails_before_anything_is_built(tmp_path, override, line):
    """The launcher's refusals before anything is built, one per path (the command line's env sections, the
    validated config): one line, exit status 2. What each check refuses is tested on the validator itself
    (tests/unit/test_config.py, test_env_registry.py); the algo= and run.dir refusals: test_baselines_launch.py,
    test_env_plugin.py."""
    proc = _run([sys.executable, "launch/train.py", override], tmp_path / "run")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [line], proc.stderr[-2000:]
    assert not list((tmp_path / "run").glob("*"))  # nothing written (Hydra may leave the empty folder)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed (extra [deepspeed])")
def test_deepspeed_launcher(tmp_path):
    env = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": os.path.join(ROOT, ".cache", "torch_extensions")}
    # two ranks: the launcher's environment and rendezvous are what is under test (tp x dp at 4 ranks: torchrun's)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           "launch/train.py", "parallel.launcher=deepspeed", "parallel.tp=2", *SHORT]
    s = _summary(_run(cmd, tmp_path / "run", env))
    assert s["steps"] == 2 and s["comm_bytes_per_step"] > 0


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI not installed")
def test_mpirun(tmp_path):
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", f"MASTER_PORT={free_port()}",
           sys.executable, "launch/train.py", "parallel.dp=2", *SHORT]
    s = _summary(_run(cmd, tmp_path / "run"))
    assert s["steps"] == 2 and s["comm_bytes_per_step"] > 0
