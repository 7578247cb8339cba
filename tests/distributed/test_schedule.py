"""Dynamic member scheduling: whichever dp group ran which member, the ledger and the weights are dp=1's."""
import pytest
import torch

from esopt_mp.models import build_tiny_qwen35
from tests.distributed import workers
from esopt_mp.parallel.local_world import run_world

STEPS = 2
RUNS = (("dynamic", "snapshot"), ("dynamic", "subtract"), ("static", "snapshot"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    model = build_tiny_qwen35(str(tmp_path_factory.mktemp("model") / "tiny"), seed=3)
    out = {}
    for dp in (1, 2, 4):
        d = tmp_path_factory.mktemp(f"dp{dp}")
        run_world(dp, workers.schedule_worker, model, str(d / "run"), str(d / "out.pt"), STEPS)
        out[dp] = torch.load(d / "out.pt")
    return out


def _entries(ledger):
    return [{k: v for k, v in e.items() if k != "wall_time"} for e in ledger]


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("run", RUNS, ids=["-".join(r) for r in RUNS])
def test_the_ledger_and_weights_are_dp1s_whichever_group_ran_a_member(results, dp, run):
    got, want = results[dp][run], results[1][run]
    assert _entries(got["ledger"]) == _entries(want["ledger"])
    assert got["weights"].keys() == want["weights"].keys()
    for k, w in want["weights"].items():
        assert torch.equal(got["weights"][k], w), k  # bit for bit: the same updates in the same order


@pytest.mark.parametrize("dp", [2, 4])
def test_a_held_back_member_leaves_the_rest_to_the_free_groups(results, dp):
    population = len(results[dp][RUNS[0]]["ledger"][0]["seeds"])
    for run in RUNS[:2]:
        ran = results[dp][run]["ran"]
        for t in range(STEPS):
            groups = [sorted(m for s, m in r if s == t) for r in ran]
            assert sorted(m for g in groups for m in g) == list(range(population))  # each member once
            assert [0] in groups, groups  # the held-back member's group ran it alone
    ran = results[dp][("static", "snapshot")]["ran"]
    for t in range(STEPS):
        assert [sorted(m for s, m in r if s == t) for r in ran] == [list(range(g, population, dp)) for g in range(dp)]


@pytest.mark.parametrize("dp", [2, 4])
def test_no_queue_counter_outlives_its_step(results, dp):
    assert results[dp]["queues"] >= 2 * STEPS  # the dynamic runs' queues, one a step
    assert results[dp]["queue_keys_left"] == []
