"""The installed ``esopt`` console script from another directory: one ES step of the embedded default, then the
run exported, as a user types them."""
import json
import os
import subprocess
import sys

ESOPT = os.path.join(os.path.dirname(sys.executable), "esopt")


def test_esopt_trains_and_exports_from_any_directory(tmp_path):
    assert os.path.isfile(ESOPT), "pip install -e . installs the esopt console script beside python"
    env = {**os.environ, "ESOPT_THREADS": "1"}
    run = tmp_path / "run"
    p = subprocess.run([ESOPT, "train", f"run.dir={run}", "es.steps=1", "run.eval_every=0"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1 and (run / "history.jsonl").is_file()
    p = subprocess.run([ESOPT, "export", "--run-dir", str(run), "--out", str(tmp_path / "hf")], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "hf" / "config.json").is_file()
    p = subprocess.run([ESOPT, "train", "es.popultion=4"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2 and "did you mean 'es.population'" in p.stderr
