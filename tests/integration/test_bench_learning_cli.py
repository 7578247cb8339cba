"""The learning benchmark's command on bad input: one line saying what is wrong, never a traceback, nothing
written."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*argv):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_learning.py"), *argv],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.parametrize("argv,line", [
    (["--jobs", "0"], "argument --jobs: '0' is not a whole number >= 1"),
    (["--seeds", "0", "-1"], "argument --seeds: '-1' is not a whole number >= 0"),
    (["--evals", "x"], "argument --evals: 'x' is not a whole number >= 1"),
    (["--episodes", "96", "--methods", "es", "grpo"], "error: 96 training episodes is not a whole number of steps"),
])
def test_bad_arguments_are_one_line(tmp_path, argv, line):
    p = _run(*argv, "--out", str(tmp_path / "out"))
    assert p.returncode in (1, 2) and line in p.stderr.strip().splitlines()[-1] and "Traceback" not in p.stderr
    assert not (tmp_path / "out").exists()


def test_a_plot_of_a_missing_or_foreign_file_is_one_line(tmp_path):
    missing = tmp_path / "missing.json"
    p = _run("--plot", str(missing))
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip() == f"error: --plot {missing}: not a learning benchmark report " \
                               f"(FileNotFoundError: [Errno 2] No such file or directory: '{missing}')"
    (tmp_path / "other.json").write_text(json.dumps([1, 2]))
    p = _run("--plot", str(tmp_path / "other.json"))
    assert p.returncode == 1 and p.stderr.strip().startswith(f"error: --plot {tmp_path / 'other.json'}: not a")
    assert not list(tmp_path.glob("*.png"))


def test_a_report_with_no_finished_run_is_refused_and_writes_nothing(tmp_path):
    p = _run("--report-only", "--methods", "es", "grpo", "--out", str(tmp_path))
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == f"error: nothing to report: no finished run of es grpo, seeds 0 1 2, " \
                                                f"in {tmp_path}"
    assert not list(tmp_path.iterdir())
