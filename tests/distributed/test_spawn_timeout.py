"""run_world kills and reports a world that outlives its timeout (a rank stuck in a collective) instead of hanging."""
import time, pytest
from esopt_mp.parallel.local_world import run_world

def _hang(rank, world, path):
    if rank == 1:
        time.sleep(60)
        open(path, "w").close()  # reached only if the world was left to run on

def _ok(rank, world):
    pass

def test_a_hung_rank_fails_the_world_within_its_timeout(tmp_path):
    with pytest.raises(AssertionError, match="still running"):
        run_world(2, _hang, str(tmp_path / "finished"), timeout=3)
    assert not (tmp_path / "finished").exists()  # killed at its timeout, not waited for
    run_world(2, _ok)
