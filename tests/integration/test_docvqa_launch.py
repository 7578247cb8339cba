"""ES on DocVQA through the normal entry point: the tiny agent, generated documents, Mean@4 / Pass@4 written."""
import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.skipif(shutil.which("tesseract") is None, reason=(
    "tesseract not installed (apt-get install tesseract-ocr fonts-dejavu-core)"))]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_es_run_on_generated_documents(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "launch/train.py", "env.name=docvqa", "env.max_turns=2", "env.n_train=4", "env.n_eval=2",
           "env.episodes_per_step=2", "env.eval_repeats=4", "env.eval_temperature=1.0",
           f"+env.docvqa.gen_dir={tmp_path / 'docs'}", "es.steps=2", "es.population=2", "engine.max_new_tokens=24",
           "run.eval_every=0", f"run.dir={run}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    details = [r["eval_detail"] for r in rows if "eval_detail" in r]
    assert len(details) == 2 and all(d["k"] == 4 and d["questions"] == 2 for d in details)
    assert all(0.0 <= d["mean@4"] <= d["pass@4"] <= 1.0 for d in details)
    summary = rows[-1]["summary"]
    assert summary["eval_before"] == details[0]["mean@4"] and summary["eval_after"] == details[1]["mean@4"]
    traj = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    assert {t["kind"] for t in traj} == {"train", "eval"} and sum(t["kind"] == "eval" for t in traj) == 2 * 2 * 4
    assert all("/workspace/document.png" in t["turns"][0]["prompt"] for t in traj)
    assert len(os.listdir(tmp_path / "docs")) == 4 + 2 * 2  # train and held-out pages, generated, nothing fetched
