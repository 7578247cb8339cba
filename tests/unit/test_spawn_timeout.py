"""run_world kills and reports a world that outlives its timeout (a rank stuck in a collective) instead of hanging."""
import time, pytest
from esopt_mp.parallel.spawn import run_world

def _hang(rank, world):
    if rank == 1:
        time.sleep(60)

def _ok(rank, world):
    pass

def test_a_hung_rank_fails_the_world_within_its_timeout():
    t = time.monotonic()
    with pytest.raises(AssertionError, match="still running"):
        run_world(2, _hang, timeout=3)
    assert time.monotonic() - t < 30
    run_world(2, _ok)
