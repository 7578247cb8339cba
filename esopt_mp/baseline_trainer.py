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
state (``baseline/rank<r>.pt``); rerunning the command in the same run.dir
resumes from it exactly: every draw of a step (its tasks, episode seeds,
minibatch order) is derived from the run seed, the step and the update count,
not carried in a generator's state, so nothing else is needed. It resumes at
the layout it was saved at (each rank reads its own file).
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
from esopt_mp.build import build_engine, build_player, build_tokenizer
from esopt_mp.checkpoint import CheckpointError
from esopt_mp.resume import agree_on_failure
from esopt_mp.config import TrainConfig
from esopt_mp.engine.base import SamplingParams
from esopt_mp.core.errors import FAILURE_KINDS
from esopt_mp.es.seeds import stream_seed
from esopt_mp.identity import config_identity
from esopt_mp.metrics import MetricsWriter
from esopt_mp.models import load_model, resolve_model_dir
from esopt_mp.parallel import CommStats, ParallelDims
from esopt_mp.runfiles import open_run_file, run_subdir, write_config

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
        self.name = cfg.algo.name
        self.steps = cfg.algo.steps or cfg.es.steps
        self.seed = cfg.run.seed  # tasks, episodes and evaluation draw from its streams
        os.makedirs(cfg.run.dir, exist_ok=True)
        self.metrics = MetricsWriter(os.path.join(cfg.run.dir, "metrics.jsonl"), dims.rank,
                                     cfg.run.loggers, cfg.to_dict())
        path = resolve_model_dir(cfg.model, cfg.run.dir, dims, agent=True)  # as the ES trainer resolves it
        self.model = load_model(path, dims, cfg.model.dtype)
        self.tokenizer = build_tokenizer(path)
        self.player = build_player(cfg, dims, build_engine(cfg, self.model, self.tokenizer))
        self.held_out = HeldOut(self.player)
        self.rollout_cfg = build_agent_config(cfg.env, rollout_sampling(cfg.engine, cfg.algo))
        self.optimizer = build_baseline(cfg.algo.name, self.model, cfg.algo, dims)
        identity = config_identity(cfg, path)
        self.config_hash = identity["hash"]
        self.start_step = self._resume()
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

    def _checkpoint_path(self) -> str:
        return os.path.join(self.cfg.run.dir, "baseline", f"rank{self.dims.rank}.pt")

    def _layout(self) -> dict:
        return {"world": self.dims.world_size, "dp": self.dims.dp, "tp": self.dims.tp}

    def save(self, step: int) -> str:
        out = run_subdir(os.path.join(self.cfg.run.dir, "baseline"))
        path = os.path.join(out, os.path.basename(self._checkpoint_path()))
        with open_run_file(path + ".tmp", "wb") as f:  # a link is refused; the rename replaces one at ``path``
            torch.save({"step": step, "config_hash": self.config_hash, "layout": self._layout(),
                        **self.optimizer.state_dict()}, f)
        os.replace(path + ".tmp", path)
        return path

    def _resume(self) -> int:
        """The step this run starts at: 0, or the step its checkpoint in run.dir was saved after, with the weights,
        masters and optimizer state loaded. One verdict for all ranks: a rank that cannot load (another config or
        layout, a missing or unreadable file) or that holds another step than its peers makes every rank raise
        the same line at once."""
        path, start, err = self._checkpoint_path(), 0, None
        try:
            start = self._load(path) if os.path.isfile(path) else 0
        except Exception as e:  # noqa: BLE001 (agreed on, then raised on every rank)
            err = e if isinstance(e, CheckpointError) else CheckpointError(f"{path}: cannot resume from it: {e}")
        agree_on_failure(self.dims, err, "resuming the run")
        if self.dims.world_size > 1:
            lo = -int(self.dims.comm.all_reduce(torch.tensor([-start]), "max", "world")[0])
            hi = int(self.dims.comm.all_reduce(torch.tensor([start]), "max", "world")[0])
            if lo != hi:
                raise CheckpointError(f"the ranks' checkpoints in {os.path.dirname(path)} were saved after different "
                                      f"steps ({lo} to {hi}; a save cut short on some rank): the run cannot resume "
                                      "from them; start it in a new run.dir")
        if start:
            log.info("resumed: %s checkpoint after step %d", self.name.upper(), start)
        return start

    def _load(self, path: str) -> int:
        sd = torch.load(path, map_location="cpu", weights_only=True)
        done = int(sd["step"])
        if sd.get("config_hash") not in (None, self.config_hash):
            raise CheckpointError(f"{path} was written by another configuration (config hash {sd['config_hash']}, "
                                  f"this run's {self.config_hash}): use that run's config, or a new run.dir")
        layout = sd.get("layout")
        if layout is not None and layout != self._layout():
            raise CheckpointError(f"{path} was saved at {_describe(layout)} and this run is {_describe(self._layout())}"
                                  ": a baseline run resumes at the layout it was saved at")
        if done > self.steps:
            raise CheckpointError(f"{path} was saved after {done} steps and this run has {self.steps}: use that "
                                  "run's steps, or a new run.dir")
        self.optimizer.load_state_dict(sd)
        return done

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
    return f"world {layout['world']} = dp {layout['dp']} x tp {layout['tp']}"


class _Ep:
    """The fields of ``core.types.Episode`` a TokenBatch needs (what the TP leader broadcasts)."""

    def __init__(self, token_ids, spans, ret):
        self.token_ids, self.spans, self.ret, self.id = token_ids, spans, ret, ""
