"""Failures on one rank reach every rank: a resume that fails on one rank only, and an unfinished asynchronous
checkpoint write inside its writer group on an error path (spawned gloo worlds)."""
import os

import torch

from esopt_mp.parallel.local_world import run_world


def test_a_read_failure_on_one_rank_fails_every_rank_with_the_same_line(tmp_path):
    """Only rank 1's checkpoint read fails (no older checkpoint to fall back on): both ranks raise the same
    CheckpointError naming rank 1 and the cause, before either enters a training collective."""
    from esopt_mp.models import build_tiny_qwen35
    from esopt_mp.parallel import ParallelDims
    from esopt_mp.trainer import ESTrainer
    from tests.distributed.workers import _cfg
    from tests.integration.resume_workers import failing_read_worker

    model = build_tiny_qwen35(str(tmp_path / "tiny"), seed=3, num_hidden_layers=2)
    run = str(tmp_path / "run")
    tr = ESTrainer(_cfg(1, 1, model, run, "seed_hash", 4, population=4), ParallelDims(1, 1, 1))
    for t in range(2):
        tr.step(t)
    tr.save(2)
    tr.ckpt.wait()
    tr.close()
    run_world(2, failing_read_worker, model, run, str(tmp_path / "got"), timeout=300)
    got = [torch.load(tmp_path / f"got.{r}") for r in range(2)]
    assert got[0] == got[1], got
    name, msg = got[0]
    assert name == "CheckpointError"
    assert msg.startswith("resuming the run failed on rank 1: ") and "Input/output error" in msg
    assert "no older checkpoint could replace" in msg


def test_close_abandons_a_write_still_inside_its_group(tmp_path):
    """Rank 1's write stalls, so rank 0's DCP save waits in the writer group's collective (its timeout: 900 s):
    close() on both returns and both processes exit, well inside the world's 240 s bound; the unfinished save is
    left as step_N.tmp, never finalized, and the next save removes it."""
    from esopt_mp import checkpoint as ck
    from esopt_mp.parallel import ParallelDims
    from tests.integration.resume_workers import abandoned_save_worker
    from tests.fixtures.checkpoints import perturber, states_at

    run = str(tmp_path / "run")
    run_world(2, abandoned_save_worker, run, str(tmp_path / "closed"), timeout=240)
    assert all(torch.load(tmp_path / f"closed.{r}") for r in range(2))
    assert os.listdir(os.path.join(run, "ckpt")) == ["step_000001.tmp"] and ck.checkpoint_steps(run) == []
    ck.save_checkpoint(run, 1, perturber(states_at(1)[1]), ParallelDims(1, 1, 1))
    assert os.listdir(os.path.join(run, "ckpt")) == ["step_000001"]


def test_a_write_failure_on_one_rank_fails_every_rank_with_the_same_line(tmp_path):
    """Rank 1's disk is full while both ranks write the step's checkpoint: both raise the same CheckpointError,
    naming the failing rank and the cause, and no checkpoint is left."""
    from esopt_mp import checkpoint as ck
    from tests.integration.resume_workers import failing_write_worker

    run = str(tmp_path / "run")
    run_world(2, failing_write_worker, run, str(tmp_path / "got"), timeout=240)
    got = [torch.load(tmp_path / f"got.{r}") for r in range(2)]
    assert got[0] == got[1], got
    name, msg = got[0]
    assert name == "CheckpointError" and "step 1 was not written (rank " in msg and "No space left" in msg, msg
    assert ck.checkpoint_steps(run) == [] and os.listdir(os.path.join(run, "ckpt")) == []
