"""BaselineTrainer: agentic GRPO / PPO on the ES trainer's agent loop, environments and metrics.

A step: ``algo.tasks_per_step`` training tasks drawn from the run's ``tasks``
stream; each dp group plays its share (task j on group j % dp), every task
``algo.generations`` times, episode seeds from the ``episode`` stream
(step, generation, task); the TP leader broadcasts its episodes' tokens to its
peers, and every rank builds the same :class:`TokenBatch` and takes one
:meth:`PolicyOptimizer.update`. ``metrics.jsonl`` gets the ES trainer's
records (``step``/``return_mean``/``return_max``, ``eval_step``/``eval``,
``summary``), so curves overlay; :func:`esopt_mp.runner.run` drives it as it
drives ES (evaluations, checkpoints, the stop on a signal, the summary). A
checkpoint is a ``torch.save`` of each rank's weights, fp32 master and AdamW
state (``baseline/rank<r>.pt``, the newest two kept:
:mod:`esopt_mp.baselines.checkpoint`); rerunning the command in the same
run.dir resumes from it exactly: every draw of a step (its tasks, episode
seeds, minibatch order) is derived from the run seed, the step and the update
count, not carried in a generator's state, so nothing else is needed. It
resumes at the layout it was saved at (each rank reads its own file).
"""
from __future__ import annotations

import logging
import math
import os
import time

import torch

from esopt_mp.agent.episodes import step_task_indices
from esopt_mp.agent.loop import build_agent_config
from esopt_mp.baselines import build_baseline, build_token_batch
from esopt_mp.baselines import checkpoint as ckpt
from esopt_mp.build import build_engine, build_player, build_tokenizer
from esopt_mp.checkpoint import CheckpointError
from esopt_mp.resume import agree_on_failure
from esopt_mp.config import TrainConfig
from esopt_mp.engine.base import SamplingParams
from esopt_mp.core.errors import FAILURE_KINDS
from esopt_mp.es.seeds import stream_seed
from esopt_mp.identity import config_identity, recorded_difference
from esopt_mp.metrics import MetricsWriter
from esopt_mp.models import load_model, resolve_model_dir
from esopt_mp.parallel import CommStats, ParallelDims
from esopt_mp.runfiles import write_config

log = logging.getLogger(__name__)


def rollout_sampling(engine_cfg, algo_cfg) -> SamplingParams:
    """On-policy sampling: plain softmax(logits / T), the distribution the loss's log-probs are taken from.

    The engine's top_p / top_k / min_p / presence penalty would make the samples come from another
    distribution than the one the policy gradient and the KL assume (with no importance weight for it).
    """
    return SamplingParams(temperature=algo_cfg.temperature, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0,
                          max_new_tokens=engine_cfg.max_new_tokens)


class BaselineTrainer:
    def __init__(self, cfg: TrainConfig, dims: ParallelDims):
        from esopt_mp.agent.held_out import HeldOut

        self.cfg, self.dims, self.algo = cfg, dims, cfg.algo
        self._comm0 = dims.comm.stats.copy()  # the process's counters; this trainer reports its own share
        self.resumes = not cfg.algo.zero_stage  # DeepSpeed's engine keeps its optimizer state to itself
        self.reuses_held_out = True  # a resumed run's first held-out score may be read back (esopt_mp.runner)
        self.name = cfg.algo.name
        self.steps = cfg.algo.steps or cfg.es.steps
        self.seed = cfg.run.seed  # tasks, episodes and evaluation draw from its streams
        os.makedirs(cfg.run.dir, exist_ok=True)
        self.metrics = MetricsWriter(os.path.join(cfg.run.dir, "metrics.jsonl"), dims.rank,
                                     cfg.run.loggers, cfg.to_dict())
        path = resolve_model_dir(cfg.model, cfg.run.dir, dims, agent=True)  # as the ES trainer resolves it
        identity = config_identity(cfg, path)
        self.config_hash = identity["hash"]
        resume = self._checkpoint_to_resume(identity)  # checked before any model is loaded
        self.model = load_model(path, dims, cfg.model.dtype)
        self.tokenizer = build_tokenizer(path)
        self.player = build_player(cfg, dims, build_engine(cfg, self.model, self.tokenizer))
        self.held_out = HeldOut(self.player)
        self.rollout_cfg = build_agent_config(cfg.env, rollout_sampling(cfg.engine, cfg.algo))
        self.optimizer = build_baseline(cfg.algo.name, self.model, cfg.algo, dims)
        self.start_step = self._resume(resume)
        write_config(cfg, dims.rank, path, identity)
        n = sum(p.numel() for p in self.model.parameters())
        log.info("%s on %d local parameters (%s weights), %d tasks x %d rollouts per step", cfg.algo.name.upper(), n,
                 cfg.model.dtype, cfg.algo.tasks_per_step, cfg.algo.generations)

    # ------------------------------------------------------------------ rollouts
    def step_tasks(self, step: int) -> list[int]:
        """Indices of the step's training tasks, drawn as ES draws them."""
        return step_task_indices(len(self.player.train_tasks), self.seed, step, self.algo.tasks_per_step)

    def rollouts(self, step: int):
        """(this dp group's episodes as a TokenBatch on every rank of the group, [sum, count, failed, max])."""
        dims, G = self.dims, self.algo.generations
        chosen = self.step_tasks(step)
        mine = [j for j in range(len(chosen)) if j % dims.dp == dims.dp_rank]
        tasks = [self.player.train_tasks[chosen[j]] for j in mine for _ in range(G)]
        groups = [j for j in mine for _ in range(G)]
        seeds = [stream_seed(self.seed, "episode", step, g, j) for j in mine for g in range(G)]
        eps = self.player.play(tasks, seeds, self.rollout_cfg, kind="train", step=step)  # [] on TP peers
        payload = [(ep.token_ids, ep.spans, ep.ret, gr) for ep, gr in zip(eps, groups)]
        rets = [ep.ret for ep in eps]  # counted once per group: where they were played
        ok = [r for r in rets if not math.isnan(r)]
        # an infrastructure-failed episode was played once more (the player's rule); it counts here only once
        local = [sum(ok), len(ok), len(rets) - len(ok), *self.player.take_failures(), self.player.take_retried()[0]]
        if dims.tp > 1:  # every rank of the group trains on its leader's episodes
            payload = dims.comm.broadcast_object(payload, src=dims.rank - dims.tp_rank, dim="tp")
        eps = [_Ep(ids, spans, ret) for ids, spans, ret, _ in payload]
        batch = build_token_batch(eps, self.player.engine.pad_id, groups=[gr for *_, gr in payload])
        totals = dims.comm.all_reduce(torch.tensor(local, dtype=torch.float64), "sum", "world")
        best = dims.comm.all_reduce(torch.tensor([max(ok) if ok else -math.inf], dtype=torch.float64), "max", "world")
        return batch, [*totals.tolist(), float(best[0])]

    # ------------------------------------------------------------------ run
    @property
    def comm_stats(self) -> CommStats:
        """Bytes this trainer's collectives moved (counted at the calls)."""
        return self.dims.comm.stats - self._comm0

    def evaluate(self) -> float:
        """Held-out Mean@k with the current weights; its detail (Pass@k, failures) to metrics, as ES writes it."""
        return self.metrics.held_out(self.held_out.evaluate())

    def step(self, t: int) -> dict:
        t0 = time.perf_counter()
        batch, (total, n, failed, *kinds, retried, best) = self.rollouts(t)
        t_roll = time.perf_counter()
        stats = self.optimizer.update(batch)
        return {"step": t, "algo": self.algo.name, "lr": self.algo.lr,
                "return_mean": total / n if n else math.nan, "return_max": best if n else math.nan,
                "failed": int(failed), "episodes": int(n + failed), "tokens": int(batch.loss_mask.sum()),
                "episodes_failed": {k: int(c) for k, c in zip(FAILURE_KINDS, kinds)},
                **({"retried": {"episodes": int(retried)}} if retried else {}),
                "rollout_s": t_roll - t0, "update_s": time.perf_counter() - t_roll,
                "step_s": time.perf_counter() - t0, **stats}

    def _layout(self) -> dict:
        """The world a checkpoint was saved in: each rank's file holds its own shards of it."""
        return {"world": self.dims.world_size, "dp": self.dims.dp, "tp": self.dims.tp}

    def save(self, step: int) -> str | None:
        """Every rank's checkpoint after ``step``; one verdict for all ranks, so a rank whose write failed (a full
        disk) does not leave the others waiting in the next step's collectives."""
        path, err = None, None
        try:
            state = {"step": step, "config_hash": self.config_hash, "layout": self._layout(), "rank": self.dims.rank,
                     **self.optimizer.state_dict()}
            path = ckpt.save(self.cfg.run.dir, self.dims.rank, state)
        except Exception as e:  # noqa: BLE001 (agreed on, then raised on every rank)
            err = CheckpointError(f"the checkpoint of step {step} was not written ({type(e).__name__}: {e}); a rerun "
                                  "resumes from the one before it")
        agree_on_failure(self.dims, err, "saving")
        return path

    def _checkpoint_to_resume(self, identity: dict) -> str | None:
        """This rank's file of the newest step every rank holds (None: start at step 0), checked against this run
        (its config, layout, rank). One verdict for all ranks: a rank that cannot resume makes every rank raise
        the same line at once."""
        err = None
        mine, unreadable = ckpt.held(self.cfg.run.dir, self.dims.rank)
        path, why = ckpt.common_step(self.dims, mine)  # a collective: every rank calls it
        try:
            stray = ckpt.stray(self.cfg.run.dir, self.dims.rank)
            if stray:
                raise CheckpointError(f"{stray[0]} is not a regular file: a run writes its checkpoints itself; "
                                      "remove it")
            if unreadable and not mine:
                raise CheckpointError(f"no checkpoint of rank {self.dims.rank} can be read ({'; '.join(unreadable)})"
                                      ": move run.dir/baseline aside to start the run over")
            if why:
                raise CheckpointError(f"{os.path.join(self.cfg.run.dir, 'baseline')}: {why}; start it in a new "
                                      "run.dir")
            if path is not None:
                self._check(path, identity)
        except Exception as e:  # noqa: BLE001 (agreed on, then raised on every rank)
            err = e if isinstance(e, CheckpointError) else \
                CheckpointError(f"{path}: cannot resume from it: {type(e).__name__}: {e}")
        agree_on_failure(self.dims, err, "resuming the run")
        return path

    def _check(self, path: str, identity: dict) -> None:
        sd = ckpt.read(path)
        if sd["config_hash"] != self.config_hash:
            what = recorded_difference(self.cfg.run.dir, identity["fields"])
            what = f"it differs in: {what}" if what else \
                f"config hash {sd['config_hash']}, this run's {identity['hash']}"
            raise CheckpointError(f"{path} was written by another configuration ({what}): rerun with that run's "
                                  "settings to resume it, or use a new run.dir")
        if sd["layout"] != self._layout():
            raise CheckpointError(f"{path} was saved at {_describe(sd['layout'])} and this run is "
                                  f"{_describe(self._layout())}: a baseline run resumes at the layout it was saved at")
        if sd.get("rank", self.dims.rank) != self.dims.rank:
            raise CheckpointError(f"{path} holds rank {sd['rank']}'s shards, not rank {self.dims.rank}'s")

    def _resume(self, path: str | None) -> int:
        """Load the checked checkpoint ``path`` (weights, fp32 masters, AdamW state, value head): its step."""
        if path is None:
            return 0
        err, step = None, 0
        try:
            sd = ckpt.read(path)
            self.optimizer.load_state_dict(sd)
            step = int(sd["step"])
            ckpt.set_aside_after(self.cfg.run.dir, self.dims.rank, path, step)
        except Exception as e:  # noqa: BLE001 (agreed on, then raised on every rank)
            err = CheckpointError(f"{path}: cannot resume from it: {type(e).__name__}: {e}")
        agree_on_failure(self.dims, err, "resuming the run")
        log.info("resumed: %s checkpoint after step %d (%s)", self.name.upper(), step, path)
        return step

    def poll(self) -> None:
        """Saves are synchronous: nothing in flight."""

    def wait(self) -> None:
        """Saves are synchronous: nothing in flight."""

    def finish(self) -> dict:
        return {"algo": self.algo.name, "params_local": sum(p.numel() for p in self.model.parameters())}

    def close(self) -> None:
        self.metrics.close()
        self.model = self.optimizer = None


def _describe(layout: dict) -> str:
    """A layout as the refusals name it."""
    return f"world {layout['world']} = dp {layout['dp']} x tp {layout['tp']}"


class _Ep:
    """The fields of ``core.types.Episode`` a TokenBatch needs (what the TP leader broadcasts)."""

    def __init__(self, token_ids, spans, ret):
        self.token_ids, self.spans, self.ret, self.id = token_ids, spans, ret, ""
