"""Every collective of a real dp x tp agent run gets its tensors on the comm device, from esopt_mp/parallel/;
held-out evaluation is spread over dp groups; a stop request seen by one rank stops all at the same step."""
import os

import pytest
import torch

from esopt_mp.parallel.local_world import run_world
from tests.distributed import collective_workers

PARALLEL_DIR = os.path.join("esopt_mp", "parallel") + os.sep


@pytest.fixture(scope="module")
def dp2_tp2(tmp_path_factory):
    d = tmp_path_factory.mktemp("rec")
    run_world(4, collective_workers.recorded_run_worker, 2, 2, str(d / "run"), str(d / "out"), timeout=600)
    return d, [torch.load(d / f"out.{r}", weights_only=False) for r in range(4)]


def test_every_collective_on_comm_device_and_from_parallel(dp2_tp2):
    _, outs = dp2_tp2
    for rank, out in enumerate(outs):
        recs = out["records"]
        assert recs, f"rank {rank} recorded no collective"
        for name, devices, immediate, outer in recs:
            assert devices == [] or devices == [out["comm_device"]], (rank, name, devices, immediate)
            if os.sep + "esopt_mp" + os.sep in immediate:  # a direct call from project code
                assert PARALLEL_DIR in immediate, f"rank {rank}: {name} called from {immediate}"
        direct = {n.replace("all_gather_into_tensor", "all_gather_single") for n, _, i, _ in recs
                  if i.endswith(PARALLEL_DIR + "collectives.py")}
        # returns all-gather + checksum, TP checks + stop agreement + eval sum, TP messages, checkpoint barrier
        assert {"all_gather_single", "all_reduce", "broadcast", "barrier"} <= direct, direct
        users = {os.path.basename(o) for *_, o in recs}
        assert {"tp.py", "held_out.py", "trainer.py", "checkpoint.py"} <= users, users


def test_stop_seen_by_one_rank_stops_all_after_the_same_step(dp2_tp2):
    d, outs = dp2_tp2
    assert [o["summary"] for o in outs] == [{"stopped_at": 1}] * 4
    assert sorted(os.listdir(d / "run" / "ckpt")) == ["step_000001"]
    with open(d / "run" / "history.jsonl") as f:
        assert len(f.readlines()) == 1


def test_eval_spread_over_dp_groups_equals_one_group(dp2_tp2, tmp_path):
    from esopt_mp.parallel import LaunchEnv, init_distributed
    from esopt_mp.trainer import ESTrainer

    _, outs = dp2_tp2
    assert [o["played"] for o in outs] == [[4], [], [3], []]  # tasks 0,2,4,6 on group 0; 1,3,5 on group 1
    evals = {o["evals"][0] for o in outs}
    assert len(evals) == 1  # every rank gets the combined value
    dims = init_distributed(LaunchEnv(0, 1, 0, "127.0.0.1", 0, "python"), 1, 1)
    ref = ESTrainer(collective_workers.agent_cfg(1, 1, str(tmp_path / "ref")), dims).evaluate()
    assert 0 < ref < 1 and evals == {ref}  # mixed results: a wrong split or combine would show
    assert outs[0]["comm"].by_op["broadcast"][1] > 0  # TP channel bytes are counted at the call
