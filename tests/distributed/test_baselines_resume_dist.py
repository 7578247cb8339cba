"""GRPO / PPO resume in spawned gloo worlds of 2 ranks (dp=2, tp=2): a run stopped after a step and rerun in its
run.dir ends with every rank's checkpoint bit-identical to the uninterrupted run's; after a save that landed on
one rank only, both resume from the step before it and still end so; ranks that hold no common step refuse the
resume together, in one line."""
import os

import pytest
import torch

from esopt_mp.parallel.local_world import run_world
from tests.fixtures.baseline_runs import same


def _worker(rank: int, world: int, dp: int, tp: int, algo: str, root: str) -> None:
    from esopt_mp.checkpoint import CheckpointError
    from esopt_mp.parallel import discover, init_distributed
    from tests.fixtures.baseline_runs import build_baseline_trainer, play

    torch.set_num_threads(1)
    dims = init_distributed(discover(), dp, tp, backend="gloo")
    ref, cut = os.path.join(root, "ref"), os.path.join(root, "cut")
    out = {"ref": play(build_baseline_trainer(ref, algo, dims=dims)),
           "stopped": play(build_baseline_trainer(cut, algo, dims=dims), stop_after=1)}
    again = build_baseline_trainer(cut, algo, dims=dims)
    out["start"] = again.start_step
    out["cut"] = play(again)
    mine = [os.path.join(cut, "baseline", f"rank{rank}{end}") for end in (".pt", ".prev.pt")]
    out["cut_state"] = torch.load(mine[0], weights_only=True)
    # a save cut short on rank 1: its newest file never landed (rank 0's did); both resume from the step before
    if rank == 1:
        os.remove(mine[0])
    again = build_baseline_trainer(cut, algo, dims=dims)
    out["recovered_start"] = again.start_step
    out["recovered"] = play(again)
    out["recovered_state"] = torch.load(mine[0], weights_only=True)
    # rank 0's step-3 file of the abandoned attempt was moved aside at the resume: the one before the new save is 1's
    out["recovered_files"] = [torch.load(p, weights_only=True)["step"] for p in mine]
    # no step held by both ranks: refused on both, in one line
    if rank == 1:
        for path in mine:
            os.remove(path)
    try:
        build_baseline_trainer(cut, algo, dims=dims).close()
    except CheckpointError as e:
        out["refused"] = str(e)
    # a save that fails on rank 1 only: both ranks raise the same line (neither waits for the other)
    fresh = build_baseline_trainer(os.path.join(root, "fresh"), algo, dims=dims)
    if rank == 1:
        os.makedirs(os.path.join(root, "fresh", "baseline", "rank1.pt.tmp"))
    try:
        fresh.save(1)
    except CheckpointError as e:
        out["save_failed"] = str(e)
    fresh.close()
    torch.save(out, os.path.join(root, f"out{rank}.pt"))


@pytest.mark.parametrize("dp,tp,algo", [(2, 1, "grpo"), (1, 2, "ppo")])
def test_a_stopped_baseline_run_resumes_bit_identical_on_every_rank(tmp_path, dp, tp, algo):
    run_world(2, _worker, dp, tp, algo, str(tmp_path))
    for rank in range(2):
        out = torch.load(tmp_path / f"out{rank}.pt", weights_only=False)
        assert out["stopped"] == {"stopped_at": 1} and out["start"] == 1
        assert (out["cut"]["resumed_from"], out["cut"]["steps"], out["ref"]["steps"]) == (1, 3, 3)
        want = torch.load(tmp_path / "ref" / "baseline" / f"rank{rank}.pt", weights_only=True)
        assert out["cut_state"]["layout"] == {"world": 2, "dp": dp, "tp": tp}
        assert out["recovered_start"] == 1 and out["recovered"]["resumed_from"] == 1
        assert out["recovered_files"] == [3, 1]
        for got in (out["cut_state"], out["recovered_state"]):
            for part in ("model", "optimizer", "updates", *(["value_head"] if algo == "ppo" else [])):
                assert same(want[part], got[part]), (rank, part)
        base = tmp_path / "cut" / "baseline"
        assert out["refused"] == (f"resuming the run failed on rank 0 (and 1 other rank): {base}: no step is held "
                                  "by every rank's checkpoint (steps saved after: rank 0: 1, 3; rank 1: none; a save "
                                  "cut short, files removed, or another layout's run): the run cannot resume from "
                                  "them; start it in a new run.dir")
        assert out["save_failed"].startswith("saving failed on rank 1: the checkpoint of step 1 was not written "
                                             "(RunFileError: ") and "rank1.pt.tmp is not a regular file" in \
            out["save_failed"]
    if tp == 2:  # each rank saved its own shard: the files differ
        a, b = (torch.load(tmp_path / "ref" / "baseline" / f"rank{r}.pt", weights_only=True)["model"] for r in (0, 1))
        assert any(a[k].shape != b[k].shape or not torch.equal(a[k], b[k]) for k in a)
