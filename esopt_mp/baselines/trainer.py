"""BaselineTrainer: agentic GRPO / PPO on the ES trainer's agent loop, environments and metrics.

A step: ``algo.tasks_per_step`` training tasks drawn from the run's ``tasks``
stream; each dp group plays its share (task j on group j % dp), every task
``algo.generations`` times, episode seeds from the ``episode`` stream
(step, generation, task); the TP leader broadcasts its episodes' tokens to its
peers, and every rank builds the same :class:`TokenBatch` and takes one
:meth:`PolicyOptimizer.update`. ``metrics.jsonl`` gets the ES trainer's
records (``step``/``return_mean``/``return_max``, ``eval_step``/``eval``,
``summary``), so curves overlay. The final checkpoint is a ``torch.save`` of
each rank's weights and optimizer state (``baseline/rank<r>.pt``); resuming
from it is not implemented.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import time

import torch
from tqdm.auto import tqdm

from esopt_mp.agent.loop import build_agent_config, follow_episodes
from esopt_mp.baselines import build_baseline, build_token_batch
from esopt_mp.config import TrainConfig
from esopt_mp.engine.sampling import SamplingParams
from esopt_mp.envs.base import FAILURE_KINDS
from esopt_mp.es.seeds import stream_seed
from esopt_mp.identity import config_hash
from esopt_mp.metrics import MetricsWriter
from esopt_mp.models import load_model, resolve_model_dir
from esopt_mp.parallel import ParallelDims

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
        from transformers import AutoTokenizer

        from esopt_mp.agent.objective import AgentObjective

        self.cfg, self.dims, self.algo = cfg, dims, cfg.algo
        self.steps = cfg.algo.steps or cfg.es.steps
        self.seed = cfg.es.seed  # the run seed: tasks, episodes and evaluation draw from its streams
        os.makedirs(cfg.run.dir, exist_ok=True)
        self.metrics = MetricsWriter(os.path.join(cfg.run.dir, "metrics.jsonl"), dims.rank)
        path = resolve_model_dir(cfg.model, cfg.run.dir, dims, agent=True)  # as the ES trainer resolves it
        self.model = load_model(path, dims, cfg.model.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        traj = os.path.join(cfg.run.dir, "trajectories.jsonl") if cfg.run.trajectories else None
        self.objective = AgentObjective(cfg.env, cfg.engine, self.seed, self.model, self.tokenizer, dims, traj)
        self.rollout_cfg = build_agent_config(cfg.env, rollout_sampling(cfg.engine, cfg.algo))
        self.optimizer = build_baseline(cfg.algo.name, self.model, cfg.algo, dims)
        self.config_hash = config_hash(cfg, path)
        if dims.rank == 0:
            with open(os.path.join(cfg.run.dir, "config.json"), "w") as f:
                json.dump(dict(cfg.to_dict(), base_model=path, config_hash=self.config_hash), f, indent=1)
        n = sum(p.numel() for p in self.model.parameters())
        log.info("%s on %d local parameters (%s weights), %d tasks x %d rollouts per step", cfg.algo.name.upper(), n,
                 cfg.model.dtype, cfg.algo.tasks_per_step, cfg.algo.generations)

    # ------------------------------------------------------------------ rollouts
    def step_tasks(self, step: int) -> list[int]:
        rng = random.Random(stream_seed(self.seed, "tasks", step))
        return rng.sample(range(len(self.objective.train_tasks)), self.algo.tasks_per_step)

    def rollouts(self, step: int):
        """(this dp group's episodes as a TokenBatch on every rank of the group, [sum, count, failed, max])."""
        dims, G = self.dims, self.algo.generations
        chosen = self.step_tasks(step)
        mine = [j for j in range(len(chosen)) if j % dims.dp == dims.dp_rank]
        tasks = [self.objective.train_tasks[chosen[j]] for j in mine for _ in range(G)]
        groups = [j for j in mine for _ in range(G)]
        seeds = [stream_seed(self.seed, "episode", step, g, j) for j in mine for g in range(G)]
        payload = None
        if dims.is_tp_leader:
            eps = self.objective.play(tasks, seeds, self.rollout_cfg, kind="train", step=step)
            payload = [(ep.token_ids, ep.spans, ep.ret, gr) for ep, gr in zip(eps, groups)]
        else:
            follow_episodes(self.objective.engine, self.rollout_cfg, dims)
        if dims.tp > 1:
            payload = dims.comm.broadcast_object(payload, src=dims.rank - dims.tp_rank, dim="tp")
        eps = [_Ep(ids, spans, ret) for ids, spans, ret, _ in payload]
        batch = build_token_batch(eps, self.objective.engine.pad_id, groups=[gr for *_, gr in payload])
        rets = [r for *_, r, _ in payload]
        ok = [r for r in rets if not math.isnan(r)]
        lead = dims.is_tp_leader
        kinds = self.objective.take_failures()  # the leader's failed episodes by kind (peers played none)
        local = [sum(ok), len(ok), len(rets) - len(ok), *kinds] if lead else [0.0] * (3 + len(kinds))
        totals = dims.comm.all_reduce(torch.tensor(local, dtype=torch.float64), "sum", "world")
        best = dims.comm.all_reduce(torch.tensor([max(ok) if ok and lead else -math.inf], dtype=torch.float64), "max",
                                    "world")
        return batch, [*totals.tolist(), float(best[0])]

    # ------------------------------------------------------------------ run
    def evaluate(self) -> float:
        return self.objective.evaluate(self.model, None)

    def step(self, t: int) -> dict:
        t0 = time.perf_counter()
        batch, (total, n, failed, *kinds, best) = self.rollouts(t)
        t_roll = time.perf_counter()
        stats = self.optimizer.update(batch)
        return {"step": t, "algo": self.algo.name, "lr": self.algo.lr,
                "return_mean": total / n if n else math.nan, "return_max": best if n else math.nan,
                "failed": int(failed), "episodes": int(n + failed), "tokens": int(batch.loss_mask.sum()),
                "episodes_failed": {k: int(c) for k, c in zip(FAILURE_KINDS, kinds)},
                "rollout_s": t_roll - t0, "update_s": time.perf_counter() - t_roll,
                "step_s": time.perf_counter() - t0, **stats}

    def save(self, step: int) -> str:
        out = os.path.join(self.cfg.run.dir, "baseline")
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, f"rank{self.dims.rank}.pt")
        torch.save({"step": step, "config_hash": self.config_hash, **self.optimizer.state_dict()}, path + ".tmp")
        os.replace(path + ".tmp", path)
        return path

    def train(self) -> dict:
        cfg, dims = self.cfg, self.dims
        t_start = time.perf_counter()
        before = self.evaluate()
        self.metrics.write({"eval_step": 0, "eval": before})
        bar = tqdm(range(self.steps), desc=f"{self.algo.name.upper()} steps", disable=dims.rank != 0,
                   dynamic_ncols=True)
        for t in bar:
            rec = self.step(t)
            bar.set_postfix(ret=f"{rec['return_mean']:.4f}", kl=f"{rec.get('kl', 0.0):.1e}")
            if t % cfg.run.log_every == 0 or t == self.steps - 1:
                self.metrics.write(rec)
            if cfg.run.eval_every and (t + 1) % cfg.run.eval_every == 0 and t + 1 < self.steps:
                self.metrics.write({"eval_step": t + 1, "eval": self.evaluate()})
            if cfg.run.checkpoint_every and (t + 1) % cfg.run.checkpoint_every == 0 and t + 1 < self.steps:
                self.save(t + 1)
        self.save(self.steps)
        after = self.evaluate()
        self.metrics.write({"eval_step": self.steps, "eval": after})
        summary = {"algo": self.algo.name, "eval_before": before, "eval_after": after, "steps": self.steps,
                   "resumed_from": 0, "seconds": time.perf_counter() - t_start,
                   "comm_bytes_per_step": dims.comm.stats.total / self.steps,
                   "params_local": sum(p.numel() for p in self.model.parameters())}
        if torch.cuda.is_available():
            summary["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        else:
            import resource

            summary["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.metrics.write({"summary": summary})
        log.info("%s held-out score: %.4f -> %.4f over %d steps", self.algo.name.upper(), before, after, self.steps)
        return summary

    def close(self) -> None:
        self.metrics.close()
        self.model = self.optimizer = None


class _Ep:
    """The fields of ``agent.loop.Episode`` a TokenBatch needs (what the TP leader broadcasts)."""

    def __init__(self, token_ids, spans, ret):
        self.token_ids, self.spans, self.ret, self.id = token_ids, spans, ret, ""
