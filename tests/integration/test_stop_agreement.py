"""SIGUSR1 sent to ONE rank of a 2-rank run: both stop after the same step, checkpoint, exit 75; a rerun
continues exactly (same ledger and final checkpoint as an uninterrupted run)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from esopt_mp.checkpoint_export import read_checkpoint
from esopt_mp.parallel.local_world import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 6  # the signal comes after step 1: room for the stop and a rerun that goes on
# an async save is pending when the signal comes
ARGS = ["model=tiny", "objective=target_logprob", "es.population=4", f"es.steps={STEPS}", "objective.batch=2",
        "run.checkpoint_every=1", "run.keep_checkpoints=1", "run.eval_every=0", "parallel.dp=2",
        "parallel.timeout_s=120"]


def _start(run_dir, ranks=(0, 1), port=None, args=ARGS, **extra_env):
    port = port or str(free_port())
    procs = []
    for rank in ranks:
        env = dict(os.environ, **extra_env, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   CUDA_VISIBLE_DEVICES="")
        procs.append(subprocess.Popen([sys.executable, "launch/train.py", *args, f"run.dir={run_dir}"], cwd=ROOT,
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (Linux: the SigCgt mask of /proc/pid/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)


def _wait(procs):
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("ranks hung")
        out.append((p.returncode, err))
    return out


def _ledger(run_dir):
    with open(os.path.join(run_dir, "history.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in ("wall_time", "sha256")} for line in f]


def test_signal_to_one_rank_stops_all_at_the_same_step(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert [rc for rc, _ in _wait(_start(ref))] == [0, 0]
    procs = _start(run)
    ledger = run / "history.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not ledger.exists() or len(ledger.read_text().splitlines()) < 2):
        time.sleep(0.02)
    procs[1].send_signal(signal.SIGUSR1)  # rank 1 only; rank 0 never sees a signal
    results = _wait(procs)
    assert [rc for rc, _ in results] == [75, 75], [err[-2000:] for _, err in results]
    n = len(_ledger(run))
    assert 2 <= n < STEPS
    assert sorted(os.listdir(run / "ckpt")) == [f"step_{n:06d}"]  # both ranks checkpointed after step n - 1
    assert all(f"stopped after step {n}/{STEPS} on request" in err for _, err in results)
    rerun = _wait(_start(run))
    assert [rc for rc, _ in rerun] == [0, 0]
    assert f"resumed: checkpoint after step {n}, replayed 0 ledger entries" in rerun[0][1]  # the step it stopped after
    assert _ledger(run) == _ledger(ref)
    a, b = (read_checkpoint(str(d / "ckpt" / f"step_{STEPS:06d}")) for d in (ref, run))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads a process's signal mask in /proc")
def test_a_signal_to_one_rank_as_it_starts_stops_both_before_the_first_step(tmp_path):
    """A scheduler's signal before any step (rank 1 still waits for rank 0 to start, so it cannot have begun
    one) stops the run, not kills it: exit 75 on both ranks, nothing written as a step, and the same command then
    runs it whole."""
    run, port = tmp_path / "run", str(free_port())
    (one,) = _start(run, ranks=(1,), port=port)
    deadline = time.time() + 120
    while time.time() < deadline and one.poll() is None and not _catches(one.pid, signal.SIGTERM):
        time.sleep(0.01)
    one.send_signal(signal.SIGTERM)  # as torch loads, or in the rendezvous: rank 0 has not started
    results = _wait([*_start(run, ranks=(0,), port=port), one])
    assert [rc for rc, _ in results] == [75, 75], [err[-2000:] for _, err in results]
    assert all(f"stopped before step 1/{STEPS} on request; nothing new to save" in err for _, err in results)
    assert not (run / "history.jsonl").exists() or _ledger(run) == []
    assert [rc for rc, _ in _wait(_start(run))] == [0, 0]
    assert [r["step"] for r in _ledger(run)] == list(range(STEPS))


# Loaded first in each rank (sitecustomize on PYTHONPATH): tearing a process group down aborts the process, as
# gloo's destructor can when a peer has closed its sockets first; so does anything destroyed in the interpreter's
# teardown. An exit handler leaves a mark per rank.
_TEARDOWN_ABORTS = """
import atexit, os
import torch.distributed as dist

dist.destroy_process_group = lambda *a, **k: os.abort()


class _AbortsWhenDestroyed:
    def __del__(self):
        os.abort()


_KEPT = _AbortsWhenDestroyed()
atexit.register(lambda: open(os.path.join(os.environ["MARKS"], os.environ["RANK"]), "w").close())
"""


@pytest.mark.parametrize("stop", [False, True], ids=["finished", "stopped"])
def test_ranks_that_finished_or_stopped_leave_without_tearing_their_groups_down(tmp_path, stop):
    """A finished run exits 0, and a stopped one 75 (requeued), even where tearing the groups down would abort the
    process: every rank meets the others, then ends without destroying them; exit handlers still run."""
    site, marks, run = tmp_path / "site", tmp_path / "marks", tmp_path / "run"
    site.mkdir(), marks.mkdir()
    (site / "sitecustomize.py").write_text(_TEARDOWN_ABORTS)
    env = {"PYTHONPATH": os.pathsep.join([str(site), ROOT]), "MARKS": str(marks)}
    args = ARGS if stop else [a for a in ARGS if not a.startswith("es.steps=")] + ["es.steps=2"]
    procs = _start(run, args=args, **env)
    if stop:
        deadline = time.time() + 300
        while time.time() < deadline and (not (run / "history.jsonl").exists() or
                                          (run / "history.jsonl").read_text().count("\n") < 1):  # a whole line
            time.sleep(0.02)
        procs[1].send_signal(signal.SIGUSR1)
    results = _wait(procs)
    assert [rc for rc, _ in results] == ([75, 75] if stop else [0, 0]), [err[-2000:] for _, err in results]
    assert sorted(os.listdir(marks)) == ["0", "1"]
    assert len(_ledger(run)) < STEPS if stop else len(_ledger(run)) == 2
