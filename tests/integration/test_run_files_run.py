"""The run files end to end, as a user reruns a run (subprocesses): a torn or zero-filled metrics.jsonl tail is cut
on resume and the run ends with its summary and plot; a link planted in run.dir is one line, nothing written
through it."""
import json
import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = ["model=tiny", "objective=target_logprob", "es.population=2", "es.steps=2", "objective.batch=2"]


def _train(run_dir):
    return subprocess.run([sys.executable, "launch/train.py", *SHORT, f"run.dir={run_dir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))


def test_a_torn_metrics_tail_is_cut_on_resume_and_the_run_ends_with_its_summary_and_plot(tmp_path):
    run = tmp_path / "run"
    assert _train(run).returncode == 0
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 1, "return_me' + b"\0" * 4096)  # a crash mid-write, then a power loss's zeros
    os.remove(run / "training.png")
    p = _train(run)  # the rerun resumes after the last step: evaluates, summarises, plots
    assert p.returncode == 0, p.stderr[-3000:]
    assert "dropping a torn tail" in p.stderr and "run finished" in p.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_bytes().splitlines()]  # every line a record
    assert "summary" in rows[-1] and (run / "training.png").stat().st_size > 10_000


def test_a_link_planted_in_the_run_dir_is_one_line_and_nothing_is_written_through_it(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    os.symlink(outside / "metrics.txt", run / "metrics.jsonl")
    os.symlink(outside, run / "ckpt")
    p = _train(run)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr[-3000:]
    assert p.stderr.startswith("error: ") and "is a symbolic link" in p.stderr
    assert os.listdir(outside) == []
