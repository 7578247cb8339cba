"""Training entry point: compose config -> discover ranks -> build the trainer -> run it (esopt_mp.runner) -> close.

    python launch/train.py                                   # embedded default, CPU (ES)
    python launch/train.py algo=grpo                         # the same agent and tasks, GRPO (or algo=ppo)
    deepspeed --num_gpus 4 launch/train.py parallel.launcher=deepspeed parallel.dp=4 algo=grpo algo.zero_stage=2
    torchrun --nproc_per_node 4 launch/train.py parallel.tp=2 parallel.dp=2
    deepspeed --num_gpus 4 launch/train.py parallel.launcher=deepspeed parallel.tp=2 parallel.dp=2
    srun python launch/train.py ...   /   mpirun -np 2 python launch/train.py parallel.dp=2
"""
from __future__ import annotations

import json
import os
import sys

STOPPED_EXIT = 75  # EX_TEMPFAIL: stopped on SIGUSR1/SIGTERM after a checkpoint
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402


def _check_algo_arg() -> None:
    """``algo=foo``: one clear line instead of Hydra's missing-config-group traceback."""
    from esopt_mp.config import ALGOS

    for arg in sys.argv[1:]:
        key, _, value = arg.lstrip("+").partition("=")
        if key == "algo" and value not in ALGOS:
            print(f"algo: unknown algorithm {value!r}; known: {', '.join(ALGOS)}", file=sys.stderr)
            sys.exit(2)


def _open_env_sections() -> None:
    """``env.<name>.<key>=v`` may add an environment's section that the composed tree lacks (a plugin's)."""
    from esopt_mp.config import ConfigError, open_sections

    try:
        sys.argv[1:] = open_sections(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _strip_launcher_args() -> None:
    """The deepspeed launcher appends ``--local_rank=N``; Hydra accepts only overrides."""
    keep = []
    for arg in sys.argv[1:]:
        if arg.startswith("--local_rank"):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1] if "=" in arg else "0")
            continue
        keep.append(arg)
    sys.argv[1:] = keep


@hydra.main(config_path="../configs", config_name="config", version_base="1.3")
def main(hcfg: DictConfig) -> None:
    import torch

    from esopt_mp.config import build_config
    from esopt_mp.checkpoint import CheckpointError
    from esopt_mp.envs import StartupError
    from esopt_mp.ledger import LedgerError
    from esopt_mp.metrics import setup_logging
    from esopt_mp.parallel import close_distributed, discover, init_distributed
    from esopt_mp.runner import run
    from esopt_mp.trainer import ESTrainer

    launch = discover()
    setup_logging(launch.rank)
    try:
        cfg = build_config(OmegaConf.to_container(hcfg, resolve=True), launch.world_size)
        if cfg.engine.name == "vllm":
            from esopt_mp.engine.vllm import preflight

            preflight(cfg)
    except (ValueError, RuntimeError, OSError) as e:  # bad config / engine=vllm cannot run here: one line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if not torch.cuda.is_available():
        # ESOPT_THREADS wins (several runs sharing a machine; torchrun always sets OMP_NUM_THREADS=1, so not that);
        # else this node's cores split over the ranks on this node
        torch.set_num_threads(int(os.environ.get("ESOPT_THREADS")
                                  or max(1, (os.cpu_count() or 1) // launch.local_world_size)))
    dims = init_distributed(launch, cfg.parallel.dp, cfg.parallel.tp, backend=cfg.parallel.backend,
                            use_deepspeed=cfg.parallel.launcher == "deepspeed", timeout_s=cfg.parallel.timeout_s)
    trainer, code, summary = None, 0, None
    try:
        try:
            if cfg.algo.name == "es":
                trainer = ESTrainer(cfg, dims)
            else:
                from esopt_mp.baselines.trainer import BaselineTrainer

                trainer = BaselineTrainer(cfg, dims)
        except (StartupError, LedgerError, CheckpointError) as e:  # the environment cannot be played here (its
            print(f"error: {e}", file=sys.stderr)  # sandbox, browsers, server, tasks), or the run.dir holds another
            code = 2  # run (its config hash) or a checkpoint that cannot be resumed: one line
        if trainer is not None:
            try:
                summary = run(trainer)
            except StartupError as e:  # found at the first evaluation (a harness that never calls its endpoint)
                print(f"error: {e}", file=sys.stderr)
                summary, code = None, 2
        if summary is not None:
            if launch.rank == 0:
                print(json.dumps(summary))
            # 75: requeue me (the slurm scripts resubmit); a stopped run that cannot resume (the baselines) is not
            # requeued: 1, it ended unfinished
            code = 0 if "stopped_at" not in summary else STOPPED_EXIT if trainer.resumes else 1
    finally:
        if trainer is not None:
            trainer.close()
        close_distributed()
    if code:
        sys.exit(code)


if __name__ == "__main__":
    _strip_launcher_args()
    _check_algo_arg()
    _open_env_sections()
    main()
