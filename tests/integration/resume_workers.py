"""Worker bodies for the resume tests (importable by spawned children), and the elastic chain they share."""
from __future__ import annotations

import os

import torch

from esopt_mp.models import full_state_dict
from esopt_mp.parallel import discover, init_distributed
from esopt_mp.trainer import ESTrainer
from tests.distributed.workers import _cfg


def segment_worker(rank: int, world: int, dp: int, tp: int, model_path: str, run_dir: str, out_path: str,
                   steps: int, stop_at: int, dims=None, es: dict | None = None) -> None:
    """Resume ``run_dir`` at layout dp x tp, run the seed_hash objective up to ``stop_at``, checkpoint, report
    (``es``: settings over the test's, the noise mode say).

    A segment of two or more steps also saves asynchronously after its first
    step, so that write overlaps the next step's collectives (the trainer's way).
    """
    dims = dims or init_distributed(discover(), dp, tp)
    trainer = ESTrainer(_cfg(dp, tp, model_path, run_dir, "seed_hash", steps, population=4, **(es or {})), dims)
    trainer.ckpt.keep = 1
    start, restored = trainer.start_step, trainer.restored_from
    for t in range(start, stop_at):
        trainer.step(t)
        if t + 1 < stop_at and t == start:
            trainer.save(t + 1)
        trainer.ckpt.poll()
    trainer.save(stop_at)
    trainer.ckpt.wait()
    state = full_state_dict(trainer.model)
    trainer.close()
    if rank == 0:
        torch.save({"start": start, "restored": restored, "state": state}, out_path)


def resume_chain(tmp_path, chain, steps: int = 6, es: dict | None = None, segment=None) -> dict:
    """One uninterrupted 1x1 run of ``steps`` steps (the reference) and the same run cut into the segments of
    ``chain`` [(dp, tp, stop_at, step the resume starts from)], each resuming the previous one's checkpoint at its
    layout, then the last checkpoint resumed at 1x1 to the end. Asserts each segment restored the step it should;
    ``segment(i, dp, tp, stop, run)`` adds a test's checks after segment i. Returns the reference state, each
    segment's report, the 1x1 finish's report and the paths."""
    from esopt_mp.models import build_tiny_qwen35
    from esopt_mp.parallel import ParallelDims
    from esopt_mp.parallel.local_world import run_world

    model = build_tiny_qwen35(str(tmp_path / "tiny"), seed=3, num_hidden_layers=2)
    run, ref, one = str(tmp_path / "run"), str(tmp_path / "ref"), ParallelDims(1, 1, 1)
    segment_worker(0, 1, 1, 1, model, ref, str(tmp_path / "ref.pt"), steps, steps, one, es)
    out = {"want": torch.load(tmp_path / "ref.pt")["state"], "segments": [], "run": run, "ref": ref, "model": model}
    for i, (dp, tp, stop, restored) in enumerate(chain):
        run_world(dp * tp, segment_worker, dp, tp, model, run, str(tmp_path / f"seg{i}.pt"), steps, stop, None, es)
        got = torch.load(tmp_path / f"seg{i}.pt")
        assert got["start"] == got["restored"] == restored, (dp, tp, got["start"], got["restored"])
        out["segments"].append(got)
        if segment:
            segment(i, dp, tp, stop, run)
    segment_worker(0, 1, 1, 1, model, run, str(tmp_path / "last.pt"), steps, steps, one, es)
    out["last"] = torch.load(tmp_path / "last.pt")
    assert out["last"]["restored"] == chain[-1][2]
    return out


def failing_read_worker(rank: int, world: int, model_path: str, run_dir: str, out_path: str) -> None:
    """dp=2 resume of ``run_dir`` whose only checkpoint rank 1 cannot read (DCP's read fails midway there, so its
    weights are partly overwritten and no older checkpoint can replace them); saves what each rank raised."""
    import torch.distributed.checkpoint.filesystem as fs

    dims = init_distributed(discover(), 2, 1)
    if rank == 1:
        def failing(self, plan, planner):
            raise OSError(5, "Input/output error")

        fs.FileSystemReader.read_data = failing
    try:
        ESTrainer(_cfg(2, 1, model_path, run_dir, "seed_hash", 4, population=4), dims).close()
        got = None
    except Exception as e:  # noqa: BLE001 (what each rank raised is the result)
        got = (type(e).__name__, str(e))
    torch.save(got, f"{out_path}.{rank}")


def abandoned_save_worker(rank: int, world: int, run_dir: str, out_path: str) -> None:
    """tp=2, one writer group: both ranks start an asynchronous save; rank 1's write stalls (a slow disk, a hung
    mount), so rank 0's DCP save waits inside the group's collective. Both then take an error path and close."""
    import time

    from esopt_mp import checkpoint as ck
    from esopt_mp.es import Perturber
    from esopt_mp.es.shard import LocalShard, ShardInfo

    dims = init_distributed(discover(), 1, 2, timeout_s=900)  # far beyond the test's own bound
    box = torch.arange(12.0).view(2, 6)[rank : rank + 1].clone()
    p = Perturber([LocalShard(box, ShardInfo("w", (2, 6), (rank, 0), (1, 6)))])
    if rank == 1:
        real = ck.write_shards
        ck.write_shards = lambda *a: (time.sleep(900), real(*a))
    c = ck.Checkpointer(run_dir, dims, async_save=True)
    c.save(1, p)
    c.close()
    torch.save(c._pending is None, f"{out_path}.{rank}")
    # leave without tearing the process groups down: destroying the writers' group while the abandoned write is
    # inside its collective can abort the process in gloo's destructor (SIGABRT: an exit, but not a clean one)
    os._exit(0)


def failing_write_worker(rank: int, world: int, run_dir: str, out_path: str) -> None:
    """tp=2, one writer group: both ranks save; rank 1's disk is full (DCP's file write fails there only). Saves what
    each rank raised."""
    import torch.distributed.checkpoint.filesystem as fs

    from esopt_mp import checkpoint as ck
    from esopt_mp.es import Perturber
    from esopt_mp.es.shard import LocalShard, ShardInfo

    dims = init_distributed(discover(), 1, 2, timeout_s=120)
    box = torch.arange(12.0).view(2, 6)[rank : rank + 1].clone()
    p = Perturber([LocalShard(box, ShardInfo("w", (2, 6), (rank, 0), (1, 6)))])
    if rank == 1:
        def full(*a, **k):
            raise OSError(28, "No space left on device")

        fs._write_item = full
    c = ck.Checkpointer(run_dir, dims, async_save=True)
    c.save(1, p)
    try:
        c.wait()
        got = None
    except Exception as e:  # noqa: BLE001 (what each rank raised is the result)
        got = (type(e).__name__, str(e))
    c.close()
    torch.save(got, f"{out_path}.{rank}")


def subtract_worker(rank: int, world: int, dp: int, model_path: str, run_dir: str, out_path: str, steps: int,
                    dims=None) -> None:
    """``steps`` steps of target_logprob (returns depend on the weights) with es.restore=subtract at dp x 1 (the
    replicas are compared after every step: parallel.checksum_every=1); saves the weights and the returns."""
    dims = dims or init_distributed(discover(), dp, 1)
    trainer = ESTrainer(_cfg(dp, 1, model_path, run_dir, "target_logprob", steps, population=4, restore="subtract"),
                        dims)
    returns = [trainer.step(t)["return_mean"] for t in range(steps)]
    state = full_state_dict(trainer.model)
    trainer.close()
    if rank == 0:
        torch.save({"state": state, "returns": returns}, out_path)
