"""An ES run of the tiny agent with env=webarena_lite on the demo site, through the normal trainer (real Chromium)."""
import json
import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_es_steps_on_the_demo_site_write_trajectories(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "+experiment=webarena_tiny",
                        f"run.dir={run}", "es.steps=1", "env.n_eval=1"], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in open(run / "trajectories.jsonl")]
    kinds = [r["kind"] for r in rows]
    assert kinds.count("train") == 2 * 2 and kinds.count("eval") == 2  # 2 members x 2 episodes; eval before/after
    assert all(r["ended"] in ("terminated", "truncated") and r["return"] is not None for r in rows)
    assert all(r["turns"][0]["prompt"].count("# Goal") == 1 for r in rows)  # the browser's observation reached it
    steps = [json.loads(line) for line in open(run / "metrics.jsonl") if '"step"' in line]
    assert steps and steps[0]["failed"] == 0
