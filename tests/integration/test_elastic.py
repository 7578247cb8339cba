"""An elastic world: ``torchrun --nnodes 1:2`` on this host, two launcher invocations ("nodes") of one process each
and ``parallel.dp=auto``. The second node is killed mid-run: the first continues at dp=1 from its newest checkpoint;
the node comes back: the world grows to dp=2 again. The ledger is the uninterrupted single-process run's.

ESOPT_THREADS=1 keeps every rank's thread count equal (matmul sums, hence the sampled tokens, depend on it).
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as docs/gpu-clusters.md asks of elastic runs.
"""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from esopt_mp.parallel.local_world import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a harness whose episodes wait on a slow "site" (0.3 s): steps long enough to lose a node in, at little CPU
CFG = ["objective=harness", "objective.callable=tests.fixtures.harnesses:slow", "es.population=4", "es.steps=14",
       "env.episodes_per_step=2", "env.n_train=16", "env.n_eval=2", "run.eval_every=0", "run.checkpoint_every=1",
       "engine.max_new_tokens=8"]
_OUTER = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
ENV = dict({k: v for k, v in os.environ.items() if k not in _OUTER}, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
           LOGLEVEL="INFO",
           ESOPT_THREADS="1", PYTHONPATH=ROOT,
           # each rendezvous round publishes its own store address (torchrun's shared store does not re-publish it
           # when its host stays rank 0, and a node joining a grown world then waits for it forever)
           TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
RDZV = "join_timeout=120,last_call_timeout=2,close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"


def _node(run_dir, port, log):
    """One "node": an elastic torchrun agent with one worker, in its own session (killed as a whole)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "esopt-elastic",
           "--rdzv-conf", RDZV, "--max-restarts", "3", "--monitor-interval", "0.5",
           "launch/train.py", *CFG, f"run.dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _entries(run_dir):
    try:
        with open(os.path.join(run_dir, "history.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def _dp(run_dir):
    """The dp the newest start recorded (None while config.json is missing or being written)."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            return json.load(f)["parallel"]["dp"]
    except (OSError, ValueError, KeyError):
        return None


def _until(what, check, procs, logs, timeout=240):
    deadline = time.monotonic() + timeout
    while not check():
        dead = [p for p in procs if p.poll() is not None and p.returncode != 0]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {name}\n{open(path).read()[-3000:]}" for name, path in logs.items())
            pytest.fail(f"waiting for {what}: " + ("a node exited" if dead else "timed out") + f"\n{tails}")
        time.sleep(0.2)


def _kill_node(p):
    """SIGKILL to an agent and every process under it (torchrun starts each worker in a session of its own)."""
    import psutil

    try:
        tree = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for q in tree:
        try:
            q.kill()
        except psutil.NoSuchProcess:
            pass


def _listening(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_lost_node_shrinks_the_world_and_its_return_grows_it_and_the_ledger_is_uninterrupted(tmp_path):
    ref = tmp_path / "ref"
    p = subprocess.run([sys.executable, "launch/train.py", *CFG, f"run.dir={ref}"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    want = _entries(ref)
    assert len(want) == 14

    run_dir, port = str(tmp_path / "elastic"), free_port()
    logs = {k: str(tmp_path / f"{k}.log") for k in ("a", "b", "b_again")}
    files = {k: open(v, "w") for k, v in logs.items()}
    procs = []
    try:
        a = _node(run_dir, port, files["a"])  # first: it hosts the rendezvous store, and outlives the other
        procs.append(a)
        _until("node a's rendezvous store", lambda: _listening(port), procs, logs)
        b = _node(run_dir, port, files["b"])
        procs.append(b)
        _until("two steps at dp=2", lambda: _dp(run_dir) == 2 and len(_entries(run_dir)) >= 2, procs, logs)
        _kill_node(b)  # the node is lost: its agent and its worker at once
        b.wait()
        procs.remove(b)
        lost_at = len(_entries(run_dir))
        _until("two more steps at dp=1", lambda: _dp(run_dir) == 1 and len(_entries(run_dir)) >= lost_at + 2,
               procs, logs)
        assert len(_entries(run_dir)) < 14, "the run ended before the node came back: make its steps longer"
        back = _node(run_dir, port, files["b_again"])
        procs.append(back)
        _until("the world to grow back to dp=2", lambda: _dp(run_dir) == 2, procs, logs)
        for q in (a, back):
            q.wait(timeout=600)
        for name, q in (("a", a), ("b_again", back)):
            assert q.returncode == 0, f"{name} exited {q.returncode}:\n{open(logs[name]).read()[-4000:]}"
    finally:
        for q in procs:
            if q.poll() is None:
                _kill_node(q)
                q.wait()
        for f in files.values():
            f.close()
    got = _entries(run_dir)
    strip = lambda es: [{k: v for k, v in e.items() if k not in ("wall_time", "sha256")} for e in es]  # noqa: E731
    assert strip(got) == strip(want)
    assert sum(any(w != 0 for w in e["weights"]) for e in want) >= 10  # the steps moved the weights
    text = "".join(open(v).read() for v in logs.values())
    assert text.count("resumed: checkpoint after step") >= 2  # shrunk and grown, each from its newest checkpoint
