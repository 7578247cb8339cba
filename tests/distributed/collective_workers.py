"""Spawned workers that record every torch.distributed collective a real ES run makes."""
from __future__ import annotations

import os
import signal
import sys

import torch

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "broadcast",
               "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv",
               "isend", "irecv", "monitored_barrier")
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
PROJECT = os.sep + "esopt_mp" + os.sep
PARALLEL = PROJECT + "parallel" + os.sep


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def install_recorder(records: list) -> None:
    """Wrap torch.distributed's collectives.

    Records (name, tensor devices, immediate caller file, first project file outside esopt_mp/parallel/).
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in COLLECTIVES:
        if not hasattr(c10d, name):
            continue
        orig = getattr(c10d, name)

        def wrapper(*args, _orig=orig, _name=name, **kwargs):
            frame = sys._getframe(1)
            immediate = frame.f_code.co_filename
            while frame is not None and (PROJECT not in frame.f_code.co_filename
                                         or PARALLEL in frame.f_code.co_filename):
                frame = frame.f_back
            outer = frame.f_code.co_filename if frame is not None else "?"
            devices = sorted({str(t.device) for t in _tensors(list(args) + list(kwargs.values()))})
            records.append((_name, devices, immediate, outer))
            return _orig(*args, **kwargs)

        setattr(c10d, name, wrapper)
        if hasattr(c10d, name) and hasattr(dist, name):
            setattr(dist, name, wrapper)


def agent_cfg(dp: int, tp: int, run_dir: str, steps: int = 2, n_eval: int = 7):
    from esopt_mp.config import build_config

    return build_config({
        "run": {"dir": run_dir, "checkpoint_every": 0, "eval_every": 0, "trajectories": False, "seed": 3},
        "model": {"path": "builtin:tiny_agent"}, "objective": {"name": "agent"},
        "parallel": {"dp": dp, "tp": tp, "checksum_every": 1, "timeout_s": 300},
        "es": {"population": 4, "steps": steps},
        "env": {"name": "sudoku", "max_turns": 4,
                "sudoku": {"size": 4, "mask_count": 3, "show_original": False, "hints": True},
                "n_train": 8, "n_eval": n_eval, "episodes_per_step": 2},
        "engine": {"temperature": 0.0, "max_new_tokens": 10},
    }, dp * tp)


def recorded_run_worker(rank: int, world: int, dp: int, tp: int, run_dir: str, out_path: str) -> None:
    """dp x tp agent run: eval, step 0 (a TP peer of dp group 1 alone gets SIGUSR1), stop agreed, checkpoint."""
    from esopt_mp.parallel import discover, init_distributed
    from esopt_mp.runner import run
    from esopt_mp.trainer import ESTrainer

    records: list = []
    install_recorder(records)
    dims = init_distributed(discover(), dp, tp, timeout_s=300)
    trainer = ESTrainer(agent_cfg(dp, tp, run_dir), dims)
    played, evals = [], []
    player = trainer.objective.player
    play, evaluate, member_eval = player.play, trainer.evaluate, trainer.objective.evaluate_member

    def counting_play(tasks, seeds, cfg, **tags):
        if tags.get("kind") == "eval" and dims.is_tp_leader:  # TP leaders play; their peers follow
            played.append(len(tasks))
        return play(tasks, seeds, cfg, **tags)

    def signalling_eval(member):
        if member.step == 0 and rank == world - 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # only this rank sees a stop request, mid-step
        return member_eval(member)

    player.play = counting_play
    trainer.objective.evaluate_member = signalling_eval
    trainer.evaluate = lambda: evals.append(evaluate()) or evals[-1]
    summary = run(trainer)
    torch.save({"records": records, "summary": summary, "played": played, "evals": evals,
                "comm_device": str(dims.comm_device), "comm": trainer.comm_stats}, f"{out_path}.{rank}")
