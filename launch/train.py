"""Training entry point: compose config -> discover ranks -> build the trainer -> run it (esopt_mp.runner) -> close.

    python launch/train.py                                   # embedded default, CPU (ES)
    python launch/train.py --help                            # groups, profiles, the main keys
    python launch/train.py run.dry_run=true                  # every start-up check, no training
    python launch/train.py algo=grpo                         # the same agent and tasks, GRPO (or algo=ppo)
    deepspeed --num_gpus 4 launch/train.py parallel.launcher=deepspeed algo=grpo algo.zero_stage=2
    torchrun --nproc_per_node 4 launch/train.py parallel.tp=2          # parallel.dp=auto: 4 / 2 = 2 groups
    deepspeed --num_gpus 4 launch/train.py parallel.launcher=deepspeed parallel.tp=2
    srun python launch/train.py ...   /   mpirun -np 2 python launch/train.py
"""
from __future__ import annotations

import json
import logging
import os
import sys

STOPPED_EXIT = 75  # EX_TEMPFAIL: stopped on SIGUSR1/SIGTERM after a checkpoint
# Before torch loads OpenMP: threads waiting at a parallel region's end sleep instead of spinning. Spinning
# threads take a shared core from whatever else runs there and wait for each other while descheduled: an ES step
# of SmolLM2-135M (2 threads, 2 cores) beside one busy process took 3.4x its time alone spinning, 0.95x sleeping
# (tools/bench_threads.py). Alone, sleeping cost 1.32x: a user's own OMP_WAIT_POLICY (ACTIVE on a node of one's
# own) wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from esopt_mp.stop import Stop, install, restore  # noqa: E402  (torch-free)

STOP = Stop()  # the run's stop request (SIGUSR1/SIGTERM), read by the run loop at its step boundaries
# before Hydra, torch and the model load: a signal from here on stops, not kills (undone at the end: `esopt train`
# runs this file in its own process)
PREVIOUS = install(STOP) if __name__ == "__main__" else {}

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402


CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def _explain_args() -> None:
    """``--help``: the groups, the profiles, the main keys; an override Hydra would answer with a traceback (an
    unknown group option, a profile without ``+``, an unknown top-level key): one line, exit 2."""
    from esopt_mp.cli import check_overrides, help_text
    from esopt_mp.config import ConfigError

    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
            composed = OmegaConf.to_container(compose("config"), resolve=True)
        print(help_text(CONFIGS, os.environ.get("ESOPT_PROG", "python launch/train.py"),  # `esopt train`: its own name
                        composed={k: v for k, v in composed.items() if k != "hydra"}))
        sys.exit(0)
    try:
        check_overrides(sys.argv[1:], CONFIGS)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
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


def _log_threads(dims, threads: tuple[int, str]) -> None:
    """Rank 0 says which thread count each rank uses (gathered: ranks on other nodes may differ) and why."""
    seen = dims.comm.all_gather_object((dims.rank, torch_threads(), threads[1]))
    by = {}
    for rank, n, why in seen:
        by.setdefault((n, why), []).append(rank)
    logging.getLogger("esopt_mp.launch").info(
        "CPU threads per rank: %s; waiting threads %s (OMP_WAIT_POLICY=%s)",
        "; ".join(f"{n} on rank(s) {','.join(map(str, r))} ({why})" for (n, why), r in sorted(by.items(),
                                                                                          key=lambda kv: kv[1][0])),
        "spin" if os.environ.get("OMP_WAIT_POLICY", "").upper() == "ACTIVE" else "sleep",
        os.environ.get("OMP_WAIT_POLICY", ""))
    if "TORCHELASTIC_RUN_ID" in os.environ and any(why == "OMP_NUM_THREADS" and n == 1 for _, n, why in seen) \
            and (os.cpu_count() or 1) > dims.world_size:
        logging.getLogger("esopt_mp.launch").info(
            "OMP_NUM_THREADS=1 (torchrun sets it when unset): ESOPT_THREADS=N or OMP_NUM_THREADS=N uses more cores")


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


@hydra.main(config_path="../configs", config_name="config", version_base="1.3")
def main(hcfg: DictConfig) -> None:
    import torch

    from esopt_mp.config import build_config
    from esopt_mp.checkpoint import CheckpointError
    from esopt_mp.core.errors import StartupError
    from esopt_mp.ledger import LedgerError
    from esopt_mp.metrics import setup_logging
    from esopt_mp.parallel import cpu_threads, discover, init_distributed
    from esopt_mp.parallel.collectives import lost_peer
    from esopt_mp.runfiles import RunFileError
    from esopt_mp.runner import build_trainer, run
    from esopt_mp.build import check_engine
    from esopt_mp.startup import check_start, dry_run

    launch = discover()
    setup_logging(launch.rank)
    try:
        cfg = build_config(OmegaConf.to_container(hcfg, resolve=True), launch.world_size)
        if cfg.run.dry_run:  # everything a start checks, then exit: no process group, no model, no step
            report = dry_run(cfg, launch.world_size)
            if launch.rank == 0:
                print("\n".join(["dry run: every start-up check passed", *(f"  {line}" for line in report)]))
            return
        check_engine(cfg)  # engine=vllm: importable here, the model's architecture mapped
        check_start(cfg)  # run.dir writable, the model directory, the data files
    except (ValueError, RuntimeError, OSError) as e:  # bad config / engine=vllm cannot run here: one line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    threads = None
    if not torch.cuda.is_available():  # ESOPT_THREADS, else OMP_NUM_THREADS, else the node's cores over its ranks
        try:
            threads = cpu_threads(launch.local_world_size)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        torch.set_num_threads(threads[0])
    dims = init_distributed(launch, cfg.parallel.dp, cfg.parallel.tp, backend=cfg.parallel.backend,
                            use_deepspeed=cfg.parallel.launcher == "deepspeed", timeout_s=cfg.parallel.timeout_s)
    if threads is not None:
        _log_threads(dims, threads)
    trainer, code, summary, ended = None, 0, None, False
    try:
        try:
            trainer = build_trainer(cfg, dims)  # ES, or the GRPO/PPO baseline trainer
        except (StartupError, LedgerError, CheckpointError, RunFileError) as e:  # the environment cannot be
            print(f"error: {e}", file=sys.stderr)  # played here (its sandbox, browsers, server, tasks), or the run.dir
            code = 2  # holds another run (its config hash), a checkpoint that cannot be resumed or a link: one line
        if trainer is not None:
            try:
                summary = run(trainer, STOP)
            except (StartupError, RunFileError) as e:  # found at the first evaluation (a harness that never calls
                print(f"error: {e}", file=sys.stderr)  # its endpoint), or a link planted in run.dir as it ran
                summary, code = None, 2
            except CheckpointError as e:  # a checkpoint that could not be written (every rank says the same line)
                print(f"error: {e}", file=sys.stderr)
                summary, code = None, 1
            except Exception as e:  # a peer gone mid-step (killed, its node lost): one line on each survivor
                why = lost_peer(e)
                if why is None:
                    raise
                print(f"error: rank {dims.rank}: another rank left the world mid-run ({why}); this rank stops "
                      "too, and a restart resumes from the newest checkpoint", file=sys.stderr)
                summary, code = None, 1
        if summary is not None:
            if launch.rank == 0:
                print(json.dumps(summary))
            # 75: requeue me (the slurm scripts resubmit); a stopped run that cannot resume (a ZeRO baseline) is not
            # requeued: 1, it ended unfinished, unless it stopped before its first step (nothing of it to lose)
            stopped = summary.get("stopped_at")
            code = 0 if stopped is None else STOPPED_EXIT if trainer.resumes or stopped == trainer.start_step else 1
        ended = summary is not None  # the run loop returned and nothing raised after it
    finally:
        try:
            if trainer is not None:
                trainer.close()
        except BaseException:  # a tracker's close failing on rank 0: the peers meet no one (their barrier fails
            _close_world(False, dims)  # as this process ends), this rank tears down and raises
            raise
        kept = _close_world(ended and not _multirun(), dims)  # a sweep's next job runs in this process
    if kept:
        _exit_now(code)
    if code:
        sys.exit(code)


def _close_world(ended: bool, dims) -> bool:
    """On gloo, every rank whose run ended meets the others, then leaves its process groups to the process's end
    (see close_distributed: gloo may abort a rank tearing them down): True, the process must end by
    ``_exit_now``. A rank that failed tears them down as before; so does one whose peers cannot be met (a peer
    that failed after its run: gloo's barrier fails when it exits, or at parallel.timeout_s). NCCL ranks tear down
    without meeting: a barrier there cannot fail, so a failed peer would hold them until the watchdog's timeout."""
    from esopt_mp.parallel import close_distributed

    if ended and dims.backend == "gloo":
        try:
            return close_distributed(drain=True, keep=True)
        except Exception as e:  # noqa: BLE001 - a peer that left after its own run (or failed): nothing to meet
            logging.getLogger("esopt_mp.launch").warning(
                "rank %d: the other ranks could not be met after the run (%s: %s)", dims.rank, type(e).__name__, e)
    close_distributed()
    return False


def _multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _exit_now(code: int) -> None:
    """End the process without destroying the process groups left open (``exit_keeping_groups``), the stop
    signals' previous handlers back first: a signal while threads are joined ends the process again."""
    from esopt_mp.parallel import exit_keeping_groups

    restore(PREVIOUS)
    exit_keeping_groups(code)


if __name__ == "__main__":
    try:
        _strip_launcher_args()
        _explain_args()
        _open_env_sections()
        main()
    finally:
        restore(PREVIOUS)
