"""The learning benchmark's runs stop as a whole: a stop reaches every run (one launched as it came in too), a run
still starting counts as stopped, queued runs are reported as not started, and a run dir whose run is still going
is not started twice. The runs here are stand-ins for launch/train.py (a SIGTERM handler that exits 75)."""
import argparse
import json
import os
import signal
import sys
import threading
import time

import pytest

from tools import bench_learning as bl
from tools.learning_jobs import AlreadyRunning, Jobs, live_pid

# launch/train.py's behaviour: after its start (the ready file), SIGTERM ends its step and it exits 75; unstopped,
# it ends by itself after 30 s with 3 (a stop that never reached it fails the test instead of hanging it)
STAND_IN = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
open(sys.argv[1], "w").close()
time.sleep(30)
sys.exit(3)
"""


def _cmd(run_dir, handler=True):
    ready = os.path.join(run_dir, "ready")
    body = STAND_IN if handler else "import sys, time\nopen(sys.argv[1], 'w').close()\ntime.sleep(30)\nsys.exit(3)\n"
    return [sys.executable, "-c", body, ready, f"run.dir={run_dir}"], ready


def _wait_for(path):
    deadline = time.time() + 60
    while not os.path.exists(path):
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_a_stop_reaches_every_run_a_second_kills_and_a_live_run_dir_is_not_started_twice(tmp_path):
    jobs = Jobs()
    env, cwd = dict(os.environ), str(tmp_path)
    for name, handler in (("a", True), ("b", True), ("c", False)):
        cmd, ready = _cmd(str(tmp_path / name), handler)
        assert jobs.start(name, str(tmp_path / name), cmd, cwd, env)
        _wait_for(ready)
    assert live_pid(str(tmp_path / "a")) in jobs.running
    assert live_pid(str(tmp_path / "a")[:-1] + "ab") is None  # another run dir's name
    with pytest.raises(AlreadyRunning, match=r"a is still running \(pid \d+\): wait for it or stop it first"):
        jobs.start("a", str(tmp_path / "a"), _cmd(str(tmp_path / "a"))[0], cwd, env)
    jobs.request_stop()  # a and b stop after their step; c (no handler: still starting) is killed by the SIGTERM
    assert not jobs.start("d", str(tmp_path / "d"), _cmd(str(tmp_path / "d"))[0], cwd, env)  # none starts now
    ended = {key: (code, stopped) for key, _, code, _, _, stopped in (jobs.reap(), jobs.reap(), jobs.reap())}
    assert ended == {"a": (75, True), "b": (75, True), "c": (-signal.SIGTERM, True)}
    assert live_pid(str(tmp_path / "a")) is None and not (tmp_path / "a" / "bench.pid").exists()
    assert not (tmp_path / "d").exists()

    stubborn = Jobs()  # a run that does not stop on SIGTERM: the second request kills it
    cmd, ready = _cmd(str(tmp_path / "e"), handler=False)
    cmd[2] = "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + cmd[2]
    stubborn.start("e", str(tmp_path / "e"), cmd, cwd, env)
    _wait_for(ready)
    stubborn.request_stop()
    stubborn.request_stop()
    assert stubborn.reap()[2] == -signal.SIGKILL


def test_a_signal_to_the_benchmark_stops_its_run_and_reports_the_queued_one(tmp_path, monkeypatch):
    ready = str(tmp_path / "out" / "grpo-seed0" / "ready")
    monkeypatch.setattr(bl, "command", lambda run_dir, *a: _cmd(run_dir)[0])
    args = argparse.Namespace(task="default", out=str(tmp_path / "out"), methods=["grpo", "ppo"], seeds=[0], jobs=1,
                              threads=1, evals=1, report_only=False, include=None)
    todo = {m: {"argv": [], "steps": 2, "episodes_per_step": 1} for m in ("grpo", "ppo", "es")}
    args.methods = ["grpo", "ppo", "es"]
    done = tmp_path / "out" / "es-seed0"  # queued behind the stop, but finished earlier: read back, not "stopped"
    done.mkdir(parents=True)
    rows = [{"eval_step": 0, "eval": 0.25}, {"eval_step": 2, "eval": 0.5}, {"summary": {"steps": 2, "seconds": 3.0}}]
    (done / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def signal_when_started():
        _wait_for(ready)
        os.kill(os.getpid(), signal.SIGTERM)  # as scancel or kill would; run_all's handler takes it

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=signal_when_started, daemon=True).start()
    results = bl.run_all(args, todo)
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the benchmark's only while it runs
    assert [(r["method"], r.get("stopped"), r.get("after")) for r in results] == [
        ("grpo", True, None), ("ppo", True, None), ("es", None, 0.5)]
    launched = json.loads((tmp_path / "out" / "grpo-seed0" / "bench_launches.json").read_text())
    assert [e["exit"] for e in launched] == [75] and not (tmp_path / "out" / "ppo-seed0").exists()
