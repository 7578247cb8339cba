"""The entry point under every launcher, as a user runs it (subprocesses)."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from esopt_mp.parallel.local_world import free_port

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
    proc = _run([sys.executable, "launch/train.py", *SHORT, "run.loggers=[tensorboard]"], tmp_path / "run")
    s = _summary(proc)
    assert s["steps"] == 2 and s["comm_bytes_per_step"] == 0
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "return_mean" in r] == [0, 1]
    assert sum("eval" in r for r in rows) == 2 and "summary" in rows[-1]
    assert len((tmp_path / "run" / "history.jsonl").read_text().splitlines()) == 2
    assert (tmp_path / "run" / "training.png").stat().st_size > 10_000
    assert any((tmp_path / "run" / "tensorboard").iterdir())  # event file
    assert "held-out score" in proc.stderr and "ES comm / step" in proc.stderr  # the summary screen
    # stderr is not a terminal: one plain line per step, no progress bar (no cursor escapes, no carriage returns)
    assert [l.split("] ", 1)[1].split(" | ")[0] for l in proc.stderr.splitlines() if "ES step " in l] == \
        ["ES step 1/2", "ES step 2/2"]
    assert "\x1b[" not in proc.stderr and "\r" not in proc.stderr
    assert re.search(r"CPU threads per rank: 1 on rank\(s\) 0 \((ESOPT|OMP_NUM)_THREADS\)", proc.stderr)


def test_torchrun_tp2_dp2_agent_default(tmp_path):
    """The embedded default (tiny agent, Sudoku episodes) sharded tp=2 inside each of 2 dp groups."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port()),
           "launch/train.py", "parallel.tp=2", "parallel.checksum_every=1", *AGENT_SHORT]  # dp=auto: 4 / 2
    proc = _run(cmd, tmp_path / "run")
    s = _summary(proc)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["parallel"]["dp"] == 2
    assert re.search(r"CPU threads per rank: 1 on rank\(s\) 0,1,2,3 \((ESOPT|OMP_NUM)_THREADS\)", proc.stderr)
    # O(G + turns) bytes counted at our collectives (returns, stop flag, checksums, TP channel), never
    # O(parameters): a gradient all-reduce of this rank's shard would be 4 * params_local bytes
    assert s["steps"] == 2 and 0 < s["comm_bytes_per_step"] < 64 * 1024 < 4 * s["params_local"] // 10
    rows = [json.loads(l) for l in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    # rank 0 writes the episodes its dp group played: the members it took from the queue, not the other group's
    mine = {(r["step"], r["member"]) for r in train}
    assert mine and len(mine) < 2 * 4
    assert all(r["turns"] and r["ended"] in ("terminated", "truncated", "turn_budget") for r in rows)


@pytest.mark.parametrize("override,line", [
    ("parallel.tp=3", "error: parallel.tp: parallel.dp=auto takes world size / tp: the world size 1 is not a "
                      "multiple of tp=3"),
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


def _one_line(proc, pattern):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and re.fullmatch(pattern, lines[0]), proc.stderr[-3000:]


@pytest.mark.parametrize("args, pattern", [
    (["experiment=sudoku_4b"], r"error: experiment: a profile is added to the defaults: write \+experiment=sudoku_4b "
                               r"\(profiles: .*\)"),
    (["es.populaton=8"], r"error: unknown config key 'es.populaton' \(did you mean 'es.population'\?\); known keys "
                         r"here: \[.*\]"),
    (["model.path=/nonexistent/Qwen3.5-4B"], r"error: model.path: /nonexistent/Qwen3.5-4B does not exist: point "
                                             r"model.path at a local Hugging Face model directory .*"),
    (["model.path={tmp}"], r"error: model.path: .* is not a model directory \(no config.json\): .*"),
    (["run.dir={tmp}/a_file/run"], r"error: run.dir: cannot write .*a_file/run \(Not a directory\): set "
                                   r"run.dir=PATH to a directory this user can write"),
], ids=["profile_without_plus", "key_typo", "missing_model", "not_a_model", "unwritable_run_dir"])
def test_a_mistake_at_the_command_line_is_one_line(tmp_path, args, pattern):
    (tmp_path / "a_file").write_text("")
    args = [a.format(tmp=tmp_path) for a in args]
    proc = subprocess.run([sys.executable, "launch/train.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    _one_line(proc, pattern)
    assert not os.path.exists(os.path.join(ROOT, "runs", "default", "ledger.jsonl")) or args  # nothing started


def test_help_and_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, "launch/train.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "experiment profiles (+experiment=PROFILE):" in proc.stdout
    assert "  sudoku_4b_h10 " in proc.stdout and "  parallel.dp " in proc.stdout
    proc = _run([sys.executable, "launch/train.py", "run.dry_run=true"], tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] == "dry run: every start-up check passed"
    assert "  tasks: 256 training, 128 held-out" in proc.stdout.splitlines()
    assert not (tmp_path / "run").exists()  # no run.dir made: no model, config, ledger, metrics or checkpoint


@pytest.mark.parametrize("verb", ["replay", "export"])
def test_a_command_on_a_missing_run_dir_is_one_line(tmp_path, verb):
    proc = subprocess.run([sys.executable, "-m", "esopt_mp.commands", verb, "--run-dir", str(tmp_path / "nope"),
                           "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    _one_line(proc, rf"esopt {verb}: error: .*nope: no such run directory: pass --run-dir the run.dir of a training "
                    "run")


@pytest.mark.parametrize("tool, verb", [("replay.py", "replay"), ("export_hf.py", "export")])
def test_the_old_spelling_of_a_command_still_works_with_a_notice(tmp_path, tool, verb):
    proc = subprocess.run([sys.executable, f"tools/{tool}", "--run-dir", str(tmp_path / "nope"), "--out",
                           str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    notice, *rest = proc.stderr.strip().splitlines()
    assert notice == f"note: tools/{tool} is now 'esopt {verb}' (same options); this spelling goes in the next release"
    assert proc.returncode == 2 and len(rest) == 1 and rest[0].startswith(f"{tool}: error: ") and "nope" in rest[0]


def _slurm_stubs(tmp_path):
    """srun/scontrol stand-ins on PATH: srun records the command it would run."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    record = f'printf "%s\\n" "OMP_NUM_THREADS=$OMP_NUM_THREADS" "$@" > {tmp_path}/srun.args'
    (bin_ / "srun").write_text(f"#!/bin/sh\n{record}\n")
    (bin_ / "scontrol").write_text("#!/bin/sh\necho node0\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node0", SLURM_JOB_ID="7",
                SLURM_CPUS_PER_TASK="8", SLURM_NTASKS="4", SLURM_NNODES="1", ESOPT_RUNS=str(tmp_path / "runs"))


def test_slurm_scripts_take_the_profile_as_a_variable(tmp_path):
    env = _slurm_stubs(tmp_path)
    proc = subprocess.run(["bash", "slurm/sudoku_4b.sh", "es.steps=3"], cwd=ROOT, env=dict(env, PROFILE="sudoku_4b_h10",
                          OMP_NUM_THREADS="2"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / "srun.args").read_text().splitlines()
    assert args[args.index("launch/train.py") + 1:] == ["+experiment=sudoku_4b_h10", "parallel.tp=1", "es.steps=3"]
    assert "--cpus-per-task=8" in args and args[0] == "OMP_NUM_THREADS=2"  # the user's thread count is kept
    proc = subprocess.run(["bash", "slurm/sudoku_4b.sh", "+experiment=sudoku_4b_h10"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == \
        "error: the profile is a variable here: PROFILE=sudoku_4b_h10 sbatch slurm/sudoku_4b.sh (not " \
        "+experiment=sudoku_4b_h10)"
    proc = subprocess.run(["bash", "slurm/webarena_27b.sh"], cwd=ROOT, env=dict(env, PROFILE="webarena_27"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: PROFILE=webarena_27: no "
                                                           "configs/experiment/webarena_27.yaml; profiles: ahd_bpp")
    assert not (tmp_path / "srun.args").read_text().count("webarena")  # nothing was started
