"""`python launch/train.py algo=grpo|ppo` on the embedded default: same metrics records as ES runs."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = ["es.steps=2", "algo.tasks_per_step=2", "algo.generations=2", "env.n_eval=2", "env.max_turns=2",
         "run.eval_every=0"]


def _run(args, run_dir):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "launch/train.py", *args, f"run.dir={run_dir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_launch_baseline_writes_es_compatible_metrics(tmp_path, algo):
    proc = _run([f"algo={algo}", *SHORT], tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])
    assert summary["algo"] == algo and summary["steps"] == 2
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    assert [r["step"] for r in steps] == [0, 1] and all(r["episodes"] == 4 for r in steps)
    assert all(k in steps[0] for k in ("return_mean", "return_max", "grad_norm", "pg_loss"))
    assert [r["eval_step"] for r in rows if "eval" in r] == [0, 2]
    assert sum("eval_detail" in r for r in rows) == 2  # Mean@k / Pass@k beside each evaluation, as ES writes them
    assert (tmp_path / "run" / "training.png").stat().st_size > 10_000 and f"{algo.upper()} run finished" in proc.stderr
    assert {"eval_before", "eval_after", "seconds"} <= set(rows[-1]["summary"])
    assert (tmp_path / "run" / "baseline" / "rank0.pt").stat().st_size > 1_000_000  # weights + AdamW states
    assert json.loads((tmp_path / "run" / "config.json").read_text())["algo"]["name"] == algo


def test_a_signal_stops_a_baseline_after_the_step_and_the_same_command_resumes_it(tmp_path):
    """SIGUSR1 during a GRPO run: it finishes the step, saves its checkpoint and exits 75 (the slurm scripts
    requeue on 75), as ES does; the same command then resumes at the next step, without evaluating again the
    weights it evaluated before the stop, and finishes the run (tests/integration/test_baselines_resume.py shows
    the resumed run equals an uninterrupted one)."""
    run_dir, steps = tmp_path / "run", 6
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    short = [a for a in SHORT if not a.startswith("run.eval_every=")]
    args = [sys.executable, "launch/train.py", "algo=grpo", *short, "run.eval_every=1", f"es.steps={steps}",
            "run.checkpoint_every=0", f"run.dir={run_dir}"]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and proc.poll() is None and \
            not (metrics.exists() and '"step": 0' in metrics.read_text()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 75, err[-3000:]
    stopped = json.loads([l for l in out.splitlines() if l.startswith("{")][-1])["stopped_at"]
    assert 1 <= stopped < steps and f"stopped after step {stopped}/{steps} on request" in err
    assert "rerun the same command to resume" in err
    import torch

    ckpt = run_dir / "baseline" / "rank0.pt"
    assert torch.load(ckpt, map_location="cpu", mmap=True, weights_only=True)["step"] == stopped
    rerun = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed: GRPO checkpoint after step {stopped}" in rerun.stderr
    assert f"held-out score at step {stopped}: " in rerun.stderr and "not evaluated again" in rerun.stderr
    summary = json.loads([l for l in rerun.stdout.splitlines() if l.startswith("{")][-1])
    assert (summary["resumed_from"], summary["steps"]) == (stopped, steps)
    rows = [json.loads(l) for l in metrics.read_text().splitlines()]
    assert sorted({r["step"] for r in rows if "step" in r}) == list(range(steps))
    assert [r["eval_step"] for r in rows if "eval" in r] == list(range(steps + 1))  # each step's score once
    assert torch.load(ckpt, map_location="cpu", mmap=True, weights_only=True)["step"] == steps


def test_unknown_algo_is_one_clear_line(tmp_path):
    proc = _run(["algo=foo"], tmp_path / "run")
    assert proc.returncode != 0
    assert proc.stderr.strip() == "error: algo: unknown algorithm 'foo'; known: es, grpo, ppo"
    # algo.name=foo, past Hydra: AlgoConfig.validate names the key (tests/unit/baselines/test_baselines.py)
