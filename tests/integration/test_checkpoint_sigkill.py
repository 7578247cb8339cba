"""A save killed (SIGKILL) at each point of its write, in a child process, resumes exactly."""
import os
import signal
import subprocess
import sys

import pytest

from esopt_mp import checkpoint as ck
from esopt_mp import resume
from tests.fixtures.checkpoints import DIMS, ROOT, _equal, entries, full_state, perturber, states_at


_CHILD = r"""
import os, shutil, signal, sys, threading, time
from esopt_mp import checkpoint as ck
from tests.fixtures.checkpoints import DIMS, perturber, states_at
run, point = sys.argv[1], sys.argv[2]
ref = states_at(4)
ck.save_checkpoint(run, 2, perturber(ref[2]), DIMS, keep=1)
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
if point == "file":  # the data written, torn, before its digest
    real_sha = ck.file_sha256
    def torn(path):
        os.truncate(path, os.path.getsize(path) // 2)
        die()
    ck.file_sha256 = torn
elif point == "manifest":
    real_json = ck._write_json
    def torn(path, obj):
        if path.endswith(ck.MANIFEST):
            open(path, "w").write('{"format": 2, "files": {"__0_0.dis')
            die()
        real_json(path, obj)
    ck._write_json = torn
elif point == "rename":
    ck.os.replace = lambda a, b: die()
elif point == "prune":
    real_rm = shutil.rmtree
    ck.shutil.rmtree = lambda p, *a, **k: die() if p.endswith("step_000002") else real_rm(p, *a, **k)
elif point == "async":  # killed while the background thread writes, the training thread already going on
    writing, real_sha = threading.Event(), ck.file_sha256
    def slow(path):
        writing.set()
        time.sleep(30)
        return real_sha(path)
    ck.file_sha256 = slow
    c = ck.Checkpointer(run, DIMS, keep=1, async_save=True)
    p = perturber(ref[4])
    c.save(4, p)
    p.update([1, 2], [1, 1], [1.0, -1.0], 0.5)  # the next step changes the weights meanwhile
    writing.wait(60)
    die()
ck.save_checkpoint(run, 4, perturber(ref[4]), DIMS, keep=1)
"""


@pytest.mark.parametrize("point,loaded", [("file", 2), ("manifest", 2), ("rename", 2), ("prune", 4), ("async", 2)])
def test_sigkill_during_save_resumes_exactly(tmp_path, point, loaded):
    run = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", _CHILD, run, point], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    ref = states_at(4)
    pert = perturber(full_state())
    assert resume.restore_run_(run, pert, DIMS, entries(4)) == loaded
    assert _equal(pert, ref[4])
    ck.save_checkpoint(run, 4, pert, DIMS, keep=1)  # the resumed run saves again: leftovers go
    assert os.listdir(os.path.join(run, "ckpt")) == ["step_000004"]
    pert = perturber(full_state())
    assert resume.restore_run_(run, pert, DIMS, entries(4)) == 4 and _equal(pert, ref[4])
