"""Worker body for the elastic-resume test (importable by spawned children)."""
from __future__ import annotations

import torch

from esopt_mp.models import full_state_dict
from esopt_mp.parallel import discover, init_distributed
from esopt_mp.trainer import ESTrainer
from tests.distributed.workers import _cfg


def segment_worker(rank: int, world: int, dp: int, tp: int, model_path: str, run_dir: str, out_path: str,
                   steps: int, stop_at: int, dims=None) -> None:
    """Resume ``run_dir`` at layout dp x tp, run the seed_hash objective up to ``stop_at``, checkpoint, report.

    A segment of two or more steps also saves asynchronously after its first
    step, so that write overlaps the next step's collectives (the trainer's way).
    """
    dims = dims or init_distributed(discover(), dp, tp)
    trainer = ESTrainer(_cfg(dp, tp, model_path, run_dir, "seed_hash", steps, population=4), dims)
    trainer.ckpt.keep = 1
    start, restored = trainer.start_step, trainer.restored_from
    for t in range(start, stop_at):
        trainer.step(t)
        if t + 1 < stop_at and t == start:
            trainer.checkpoint(t + 1)
        trainer.ckpt.poll()
    trainer.checkpoint(stop_at)
    trainer.ckpt.wait()
    state = full_state_dict(trainer.model)
    trainer.close()
    if rank == 0:
        torch.save({"start": start, "restored": restored, "state": state}, out_path)
