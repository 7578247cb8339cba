"""``run.loggers``: tensorboard, wandb (offline) and mlflow (a local file store) receive the scalars metrics.jsonl
records, at their steps; a resumed run logs into the same tracker run. Each tracker is an extra: skipped without
it. (Integration: wandb starts its own service process.)"""
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from esopt_mp.metrics import MetricsWriter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = [{"step": t, "return_mean": 0.125 * t, "return_max": 0.25 * t, "sigma": 1e-3 / (t + 1), "failed": t % 2,
          "rollout_s": 1.5, "step_s": 2.0, "note": "text is not a scalar"} for t in range(3)]
EVALS = [{"eval_step": 0, "eval": 0.25}, {"eval_step": 3, "eval": 0.5}]


def need(*mods):
    missing = [m for m in mods if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {missing} (pip install -e '.[trackers]')")


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _write(run_dir, loggers, records):
    w = MetricsWriter(os.path.join(run_dir, "metrics.jsonl"), 0, loggers, {"es": {"population": 4}, "run": {"seed": 0}})
    for r in records:
        w.write(r)
    w.close()


def expected(records):
    """tracker key -> [(step, value)] of the records, as metrics.jsonl holds them."""
    out = {}
    for r in records:
        if "eval" in r:
            out.setdefault("eval/score", []).append((r["eval_step"], r["eval"]))
        else:
            for k, v in r.items():
                if k != "step" and isinstance(v, (int, float)):
                    out.setdefault(f"train/{k}", []).append((r["step"], float(v)))
    return out


def mlflow_history(run_dir):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="file:" + os.path.join(run_dir, "mlruns"))
    rid = open(os.path.join(run_dir, ".mlflow_run_id")).read()
    run = client.get_run(rid)
    return run, {k: sorted((m.step, m.value) for m in client.get_metric_history(rid, k)) for k in run.data.metrics}


def wandb_history(run_dir):
    """key -> the set of values the offline run's records hold (each item: the key, then its JSON value; a row is
    in a history and a summary record, so values are compared as sets)."""
    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    data, out = open(path, "rb").read(), {}
    for m in re.finditer(rb"(?=\x12([\x01-\x7f]))", data):  # overlapping: a length byte may be 0x12 itself
        n = m.group(1)[0]
        key, rest = data[m.start() + 2:m.start() + 2 + n], m.start() + 2 + n
        if data[rest:rest + 2] == b"\x82\x01" and re.fullmatch(rb"(train|eval)/[a-z_]+", key):
            vlen = data[rest + 2]
            out.setdefault(key.decode(), set()).add(json.loads(data[rest + 3:rest + 3 + vlen]))
    return out


@need("tensorboard", "wandb", "mlflow")
def test_each_tracker_gets_the_scalars_of_metrics_jsonl_at_their_steps(tmp_path, offline):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write(str(tmp_path), ["tensorboard", "wandb", "mlflow"], EVALS[:1] + STEPS + EVALS[1:])
    want = expected(EVALS[:1] + STEPS + EVALS[1:])
    assert set(want) == {"eval/score", "train/return_mean", "train/return_max", "train/sigma", "train/failed",
                         "train/rollout_s", "train/step_s"}
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {k: [(e.step, pytest.approx(e.value, rel=1e-6)) for e in acc.Scalars(k)] for k in acc.Tags()["scalars"]} \
        == want  # float32 events
    run, hist = mlflow_history(str(tmp_path))
    assert hist == want and run.data.params["es.population"] == "4" and run.info.run_name == tmp_path.name
    got = wandb_history(str(tmp_path))
    assert got == {k: {v for _, v in pts} for k, pts in want.items()}


@need("wandb", "mlflow")
def test_a_resumed_run_logs_into_the_same_tracker_runs(tmp_path, offline):
    _write(str(tmp_path), ["wandb", "mlflow"], STEPS[:2])
    ids = {n: open(tmp_path / f".{n}_run_id").read() for n in ("wandb", "mlflow")}
    _write(str(tmp_path), ["wandb", "mlflow"], STEPS[2:])
    assert {n: open(tmp_path / f".{n}_run_id").read() for n in ("wandb", "mlflow")} == ids
    _, hist = mlflow_history(str(tmp_path))
    assert hist["train/return_mean"] == [(0, 0.0), (1, 0.125), (2, 0.25)]
    runs = [os.path.basename(p) for p in glob.glob(str(tmp_path / "wandb" / "offline-run-*"))]
    assert len(runs) == 2 and all(f"-{ids['wandb']}" in r for r in runs)  # a directory per process, one run id


@need("wandb", "mlflow")
def test_a_launched_run_with_every_tracker(tmp_path):
    """The main job cut to 2 steps with run.loggers=[tensorboard,wandb,mlflow], offline: the trackers hold what
    metrics.jsonl holds."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run([sys.executable, "launch/train.py", "model=tiny", "objective=target_logprob",
                           "es.population=4", "es.steps=2", "objective.batch=2", f"run.dir={tmp_path / 'run'}",
                           "run.loggers=[tensorboard,wandb,mlflow]"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trackers: tensorboard, wandb, mlflow" in proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    want = expected([r for r in rows if "step" in r or "eval" in r])
    _, hist = mlflow_history(str(tmp_path / "run"))
    assert hist == want
    assert wandb_history(str(tmp_path / "run"))["train/return_mean"] == {v for _, v in want["train/return_mean"]}


def test_a_tracker_that_is_not_installed_is_one_line(monkeypatch):
    from esopt_mp.config import ConfigError
    from esopt_mp.trackers import check_loggers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^run.loggers: wandb is not installed: pip install -e '.\[wandb\]'"):
        check_loggers(["wandb"])
    with pytest.raises(ConfigError, match=r"^run.loggers: unknown tracker 'comet'; known: tensorboard, wandb, mlflow"):
        check_loggers(["comet"])
    with pytest.raises(ConfigError, match=r"named twice"):
        check_loggers(["tensorboard", "tensorboard"])


@need("mlflow")
def test_a_tracker_that_cannot_start_is_one_line(tmp_path, monkeypatch):
    from esopt_mp.envs.base import StartupError

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://host/x")
    with pytest.raises(StartupError, match=r"^run.loggers: mlflow could not start: \w+"):
        MetricsWriter(str(tmp_path / "metrics.jsonl"), 0, ["mlflow"])


@need("wandb")
def test_the_dry_run_refuses_an_online_wandb_without_a_login(tmp_path, monkeypatch):
    from esopt_mp.envs.base import StartupError
    from esopt_mp.trackers import check_can_start

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with pytest.raises(StartupError, match=r"^run.loggers: wandb is online but has no API key: wandb login"):
        check_can_start(["wandb"], str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert check_can_start(["wandb", "mlflow"], str(tmp_path)).startswith("trackers: wandb (offline), mlflow (")
