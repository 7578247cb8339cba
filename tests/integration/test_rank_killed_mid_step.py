"""A rank killed (SIGKILL) in the middle of a step under ``parallel.schedule=dynamic``, the default: one torchrun
agent, two workers (``parallel.dp=auto``: dp=2), whose dp groups claim the step's members from the shared queue.
Rank 1 is killed in the middle of a step: its harness (``tests.fixtures.harnesses:stall``) hangs in a member's
episode of that step, once, while rank 0's group claims the rest of the queue and waits at the returns' gather; the
step is not in the ledger when rank 1 is killed.

- ``--max-restarts 1``: torchrun restarts the worker group, which resumes from its newest complete checkpoint,
  replays the ledger past it and plays the interrupted step again: the run ends (exit 0), every step once in the
  ledger, which is the uninterrupted single-process run's.
- ``--max-restarts 0``: the run fails (non-zero exit) promptly, not after a collective's timeout (30 minutes by
  default): the survivor's gather fails at once (gloo: the peer's connection closed) and the agent ends it; the
  ledger is a prefix of the uninterrupted run's (no partial line, no step of the lost world), and the survivor says
  so in one line, not with the traceback of its failed collective.

ESOPT_THREADS=1 keeps every rank's thread count equal (matmul sums, hence the sampled tokens, depend on it).
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as docs/gpu-clusters.md asks of elastic runs.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from esopt_mp.parallel.local_world import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, KILL_IN = 5, 2  # rank 1 is killed during step KILL_IN (0-based): the steps before it are in the ledger
# a harness whose episodes wait on a slow "site" (0.3 s), and that hangs on rank 1 once (ESOPT_TEST_STALL)
CFG = ["objective=harness", "objective.callable=tests.fixtures.harnesses:stall", "es.population=8",
       f"es.steps={STEPS}", "env.episodes_per_step=2", "env.n_train=16", "env.n_eval=2", "run.eval_every=0",
       "run.checkpoint_every=1", "engine.max_new_tokens=8"]
_OUTER = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
ENV = dict({k: v for k, v in os.environ.items() if k not in _OUTER}, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
           LOGLEVEL="INFO", ESOPT_THREADS="1", PYTHONPATH=ROOT,
           # as docs/gpu-clusters.md asks of elastic runs; without it the restarted world's process group fails to
           # form (torch 2.13: the store shared with the agent keeps the lost world's gloo addresses)
           TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
_STRIP = ("wall_time", "sha256")


def _entries(run_dir):
    try:
        with open(os.path.join(run_dir, "history.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def _strip(entries):
    return [{k: v for k, v in e.items() if k not in _STRIP} for e in entries]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    ref = str(tmp_path_factory.mktemp("ref"))
    p = subprocess.run([sys.executable, "launch/train.py", *CFG, f"run.dir={ref}"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    want = _entries(ref)
    assert [e["step"] for e in want] == list(range(STEPS))
    assert sum(any(w != 0 for w in e["weights"]) for e in want) >= 3  # the steps moved the weights
    return _strip(want)


def _agent(run_dir, log, restarts, marker):
    """One torchrun agent, two workers, in its own session (killed as a whole if the test fails)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "esopt-kill",
           "--max-restarts", str(restarts), "--monitor-interval", "0.5",
           "launch/train.py", *CFG, f"run.dir={run_dir}"]
    env = dict(ENV, ESOPT_TEST_STALL=marker, ESOPT_TEST_STALL_STEP=str(KILL_IN))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _children(pid):
    """The pids whose parent is ``pid`` (a scan of /proc)."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                if name.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(name))
        except (OSError, ValueError, IndexError):
            pass
    return found


def _worker(agent, rank):
    """The agent's worker process of ``rank`` (its environment says which), or None."""
    for pid in _children(agent.pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return pid
        except OSError:
            pass
    return None


def _until(what, check, agent, log, timeout=300):
    deadline = time.monotonic() + timeout
    while not check():
        if agent.poll() is not None or time.monotonic() > deadline:
            tail = open(log).read()[-4000:]
            pytest.fail(f"waiting for {what}: " + ("the run exited" if agent.poll() is not None else "timed out")
                        + f"\n{tail}")
        time.sleep(0.1)


def _kill_rank_1_mid_step(run_dir, restarts, log_path, marker):
    """Start the run and SIGKILL rank 1 in the middle of a step >= KILL_IN: (the agent, that step). Rank 1 hangs in
    a member's episode of that step (the ``stall`` harness, once), so the step cannot end before the kill (rank 0
    records it only after gathering every group's returns), whatever the machine's load."""
    open(marker, "w").close()
    log = open(log_path, "w")
    agent = _agent(run_dir, log, restarts, marker)
    try:
        _until(f"rank 1 in a step >= {KILL_IN}", lambda: os.path.exists(marker + ".stalled"), agent, log_path)
        step = int(open(marker + ".stalled").read())
        victim = _worker(agent, 1)
        assert victim is not None, open(log_path).read()[-3000:]
        assert len(_entries(run_dir)) == step, open(log_path).read()[-3000:]  # the step is not in the ledger
        os.kill(victim, signal.SIGKILL)
        _until("rank 1 gone", lambda: _zombie(victim), agent, log_path, 60)
        return agent, step
    except BaseException:
        _stop(agent)
        raise
    finally:
        log.close()


def _zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _stop(agent):
    """SIGKILL to an agent still running and every process under it (each worker runs in a session of its own)."""
    if agent.poll() is not None:
        return
    tree, todo = [], [agent.pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += _children(pid)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def test_a_rank_killed_mid_step_is_restarted_and_the_ledger_is_uninterrupted(tmp_path, uninterrupted):
    run_dir, log = str(tmp_path / "run"), str(tmp_path / "agent.log")
    agent, _ = _kill_rank_1_mid_step(run_dir, 1, log, str(tmp_path / "stall"))
    try:
        code = agent.wait(timeout=600)
    finally:
        _stop(agent)
    text = open(log).read()
    assert code == 0, text[-4000:]
    got = _entries(run_dir)
    assert [e["step"] for e in got] == list(range(STEPS))  # every step once: the interrupted one played again
    assert _strip(got) == uninterrupted
    assert "resumed: checkpoint after step" in text  # the restarted world, from its newest checkpoint
    cfg = json.load(open(os.path.join(run_dir, "config.json")))["parallel"]
    assert (cfg["dp"], cfg["schedule"]) == (2, "dynamic")


def test_a_rank_killed_mid_step_without_restarts_fails_promptly_and_leaves_a_prefix_of_the_ledger(
        tmp_path, uninterrupted):
    run_dir, log = str(tmp_path / "run"), str(tmp_path / "agent.log")
    agent, step = _kill_rank_1_mid_step(run_dir, 0, log, str(tmp_path / "stall"))
    try:
        code = agent.wait(timeout=300)  # not a collective's timeout (parallel.timeout_s: 30 minutes)
    finally:
        _stop(agent)
    text = open(log).read()
    assert code != 0, text[-4000:]
    got = _entries(run_dir)
    assert _strip(got) == uninterrupted[:len(got)] and len(got) == step, text[-4000:]
    assert "Signal 9 (SIGKILL)" in text or "exitcode  : -9" in text, text[-4000:]  # torchrun names the lost rank
    # the survivor says so in one line, not a traceback of its failed collective
    said = [line for line in text.splitlines() if line.startswith("error: rank 0: another rank left the world")]
    assert len(said) == 1 and "Error executing job" not in text, text[-4000:]
