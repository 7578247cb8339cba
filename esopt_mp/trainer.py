"""ESTrainer: build, step, evaluate, close.

One ES step as data flow (ARCHITECTURE.md s.3): member seeds from (run seed,
step) on every rank; each dp group perturbs, evaluates and restores its own
members (m % dp == dp_rank), TP peers joining the sharded forward passes; one
all-gather of the G returns; every rank shapes them and updates its own shard.
"""
from __future__ import annotations

import logging
import math
import os
import time

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from esopt_mp.config import TrainConfig
from esopt_mp.es import Perturber, Schedule, population, shape_returns
from esopt_mp.metrics import MetricsWriter
from esopt_mp.models import build_shards, build_tiny_qwen35, load_model
from esopt_mp.objectives import Member, build_objective
from esopt_mp.parallel import CommStats, ParallelDims, check_replicas, gather_returns

log = logging.getLogger(__name__)


def _schedule(cfg, steps: int) -> Schedule:
    return Schedule(cfg.kind, cfg.start, cfg.end, cfg.steps or steps)


class ESTrainer:
    def __init__(self, cfg: TrainConfig, dims: ParallelDims):
        self.cfg, self.dims = cfg, dims
        self.comm = CommStats()
        os.makedirs(cfg.run.dir, exist_ok=True)
        self.metrics = MetricsWriter(os.path.join(cfg.run.dir, "metrics.jsonl"), dims.rank)
        self.model = load_model(self._model_path(), dims, cfg.model.dtype)
        self.shards = build_shards(self.model, cfg.es.include, cfg.es.exclude)
        es = cfg.es
        self.perturber = Perturber(self.shards, restore=es.restore, master=es.master, chunk_elems=es.chunk_elems,
                                   noise_backend=es.noise_backend)
        self.objective = build_objective(cfg.objective, self.model.config.vocab_size)
        self.sigma = _schedule(es.sigma, es.steps)
        self.alpha = _schedule(es.alpha, es.steps)
        log.info("ES on %d local parameters in %d tensors (%s restore, master %s)", self.perturber.numel,
                 len(self.shards), es.restore, es.master)

    def _model_path(self) -> str:
        if self.cfg.model.path:
            return self.cfg.model.path
        path = os.path.join(self.cfg.run.dir, "base_model")
        if self.dims.rank == 0:
            t = self.cfg.model.tiny
            build_tiny_qwen35(path, seed=t.seed, vocab_size=t.vocab_size, hidden_size=t.hidden_size,
                              num_hidden_layers=t.num_hidden_layers, intermediate_size=t.intermediate_size)
        if self.dims.distributed:
            dist.barrier()
        return path

    def evaluate(self) -> float:
        """Held-out return with the unperturbed weights (sigma = 0)."""
        return self.objective.evaluate(self.model, None)

    def step(self, t: int) -> dict:
        es, dims = self.cfg.es, self.dims
        t0 = time.perf_counter()
        seeds, signs = population(es.seed, t, es.population, es.mirrored)
        sigma, alpha = self.sigma(t), self.alpha(t)
        local = {}
        for m in dims.members(es.population):
            self.perturber.perturb(seeds[m], sigma, signs[m])
            try:
                local[m] = self.objective.evaluate(self.model, Member(t, m, seeds[m], signs[m]))
            except Exception:
                log.exception("member %d of step %d failed; its return counts as NaN", m, t)
                local[m] = math.nan
            finally:
                self.perturber.restore()
        t_eval = time.perf_counter()
        returns = gather_returns(local, es.population, dims, self.comm)
        weights = shape_returns(returns, es.shaping)
        self.perturber.update(seeds, signs, weights, alpha, es.weight_decay)
        if self.cfg.parallel.checksum_every and (t + 1) % self.cfg.parallel.checksum_every == 0:
            check_replicas([(s.info.name, s.tensor) for s in self.shards], dims, self.comm)
        finite = returns[~(returns != returns)]
        return {
            "step": t, "sigma": sigma, "alpha": alpha,
            "return_mean": float(finite.mean()) if finite.size else math.nan,
            "return_max": float(finite.max()) if finite.size else math.nan,
            "failed": int((returns != returns).sum()),
            "rollout_s": t_eval - t0, "step_s": time.perf_counter() - t0,
            "comm_bytes_total": self.comm.total, "returns": [float(r) for r in returns],
        }

    def train(self) -> dict:
        cfg = self.cfg
        before = self.evaluate()
        log.info("held-out score before ES: %.4f", before)
        bar = tqdm(range(cfg.es.steps), desc="ES steps", disable=self.dims.rank != 0, dynamic_ncols=True)
        last = {}
        for t in bar:
            last = self.step(t)
            bar.set_postfix(ret=f"{last['return_mean']:.4f}", sigma=f"{last['sigma']:.1e}")
            if t % cfg.run.log_every == 0 or t == cfg.es.steps - 1:
                self.metrics.write(last)
        after = self.evaluate()
        summary = {"eval_before": before, "eval_after": after, "steps": cfg.es.steps,
                   "comm_bytes_per_step": self.comm.total / max(1, cfg.es.steps), "params_local": self.perturber.numel}
        self.metrics.write({"summary": summary})
        log.info("held-out score: %.4f -> %.4f over %d steps", before, after, cfg.es.steps)
        return summary

    def close(self) -> None:
        self.model = None
        self.perturber = None
