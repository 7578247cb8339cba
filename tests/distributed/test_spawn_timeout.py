"""run_world kills and reports a world that outlives its timeout (a rank stuck in a collective) instead of hanging;
a rank dying by a signal inside its work fails the world, one dying in its teardown after every rank's work
returned and met at the final barrier (gloo can abort in its destructor) is a warning."""
import atexit
import os
import time

import pytest
import torch.distributed as dist

from esopt_mp.parallel.local_world import run_world


def _hang(rank, world, path):
    if rank == 1:
        time.sleep(60)
        open(path, "w").close()  # reached only if the world was left to run on


def _ok(rank, world):
    pass


def _abort(rank, world, where, path):
    dist.init_process_group("gloo")
    if rank == 0 and where == "work":
        os.abort()
    if rank == 0 and where == "teardown":
        atexit.register(os.abort)  # after run_world's final barrier and the group's destruction
    open(f"{path}.{rank}", "w").close()


def test_a_hung_rank_fails_the_world_within_its_timeout(tmp_path):
    with pytest.raises(AssertionError, match="still running"):
        run_world(2, _hang, str(tmp_path / "finished"), timeout=3)
    assert not (tmp_path / "finished").exists()  # killed at its timeout, not waited for
    run_world(2, _ok)


def test_a_rank_aborting_in_its_work_fails_the_world(tmp_path):
    with pytest.raises(AssertionError, match="SIGABRT"):
        run_world(2, _abort, "work", str(tmp_path / "done"), timeout=120)
    assert not (tmp_path / "done.0").exists()


def test_a_rank_aborting_in_its_teardown_after_every_rank_returned_is_a_warning(tmp_path):
    with pytest.warns(RuntimeWarning, match="rank 0 died by SIGABRT in its teardown"):
        run_world(2, _abort, "teardown", str(tmp_path / "done"), timeout=120)
    assert (tmp_path / "done.0").exists() and (tmp_path / "done.1").exists()
