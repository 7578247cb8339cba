"""ESTrainer: build, step, evaluate, checkpoint, close; :func:`esopt_mp.runner.run` drives it.

One ES step as data flow: member seeds from (run seed, step) on every rank;
each dp group takes members from the step's queue as it becomes free
(``parallel.schedule``: dynamic, or member m on group m % dp), perturbs,
evaluates and restores each, TP peers joining the sharded forward passes; an
infrastructure-failed episode is played once more, a member all of whose
episodes failed so evaluated once more; one all-gather of the G returns; every
rank shapes them and updates its own shard; rank 0 appends the step to the
ledger (with the failures and what was played again). At the end of every step the run loop
has the ranks agree (one all-reduce) on whether any of them was asked to stop,
so all checkpoint and exit after the same step. A restarted run loads the
newest complete checkpoint, replays the ledger tail and continues exactly where
the ledger ends.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import time

import torch
from tqdm.auto import tqdm

from esopt_mp.build import build_members, build_objective, build_weights
from esopt_mp.checkpoint import Checkpointer, Ledger, LedgerError, checkpoint_steps
from esopt_mp.checkpoint_export import export_checkpoint
from esopt_mp.config import TrainConfig
from esopt_mp.core.errors import FAILURE_KINDS, StartupError
from esopt_mp.es import Schedule, population, shape_returns
from esopt_mp.es.hostmem import malloc_trim
from esopt_mp.es.perturber import exact_restore
from esopt_mp.core.types import Member
from esopt_mp.identity import config_identity, recorded_difference
from esopt_mp.ledger import Health, updates_digest
from esopt_mp.metrics import MetricsWriter
from esopt_mp.models import resolve_model_dir
from esopt_mp.models.export import export_hf
from esopt_mp.parallel import CommStats, MemberQueue, ParallelDims, check_replicas, gather_returns
from esopt_mp.progress import interactive
from esopt_mp.resume import agree_on_failure, restore_run_
from esopt_mp.runfiles import write_config

log = logging.getLogger(__name__)


def _since(t0: float) -> float:
    """Seconds since ``t0``, after the device's queued kernels finished (CUDA ops return before they run)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _schedule(cfg, steps: int) -> Schedule:
    """``cfg.steps`` None: the schedule follows the run, start at step 0 and end at its last step (es.steps - 1),
    so a test-time schedule (end 0) really plays sigma = 0 last; a 1-step run plays the end value."""
    if cfg.steps:
        return Schedule(cfg.kind, cfg.start, cfg.end, cfg.steps)
    if steps <= 1:
        v = cfg.start if cfg.kind == "constant" else cfg.end
        return Schedule("constant", v, v, 1)
    return Schedule(cfg.kind, cfg.start, cfg.end, steps - 1)


def noise_passes(es, dp: int) -> float:
    """How many times a run regenerates each local element's noise: per step, a perturb of each member its group
    evaluates (every member, plus a restore each, under a subtract restore) and the update's sum over all G."""
    per_step = es.population / dp + es.population
    if not exact_restore(es.restore, es.master):
        per_step = 3 * es.population
    return es.steps * per_step


def _cache_warm(dims: ParallelDims) -> bool:
    """Whether every rank's kernel cache holds the compiled noise kernel (one all-reduce): the noise backend's
    choice depends on it, and every rank must take the same one."""
    from esopt_mp.es.philox import kernel_cached

    mine = torch.tensor([1.0 if kernel_cached() else 0.0], dtype=torch.float64)
    return bool(dims.comm.all_reduce(mine, "min", "world")[0] > 0)


class ESTrainer:
    """The ES side of :class:`esopt_mp.runner.Trainer`; :func:`esopt_mp.runner.run` drives it."""

    name = "es"
    resumes = True

    def __init__(self, cfg: TrainConfig, dims: ParallelDims):
        self.cfg, self.dims = cfg, dims
        # a harness's first evaluation is also its check, on every rank at once, that it calls the endpoint
        self.reuses_held_out = not cfg.objective.served
        self._comm0 = dims.comm.stats.copy()  # the process's counters; this trainer reports its own share
        os.makedirs(cfg.run.dir, exist_ok=True)
        self.metrics = MetricsWriter(os.path.join(cfg.run.dir, "metrics.jsonl"), dims.rank,
                                     cfg.run.loggers, cfg.to_dict())
        path = resolve_model_dir(cfg.model, cfg.run.dir, dims, agent=cfg.objective.episodic)
        self.base_path = path
        self.model, self.perturber, engine = build_weights(cfg, dims, path, work_passes=noise_passes(cfg.es, dims.dp),
                                                           cache_warm=_cache_warm(dims))
        try:
            self._build_rest(cfg, dims, path, engine)
        except BaseException:
            if engine is not None:
                engine.close()  # before the launcher's process groups go (vLLM's exit hook would fail after)
            raise

    def _build_rest(self, cfg: TrainConfig, dims: ParallelDims, path: str, engine) -> None:
        """Objective, schedules, ledger and resume: the same for both engines."""
        es = cfg.es
        self.shards = self.perturber.shards
        self._host_weights = any(s.tensor.device.type == "cpu" for s in self.shards)
        self.members = build_members(cfg, self.model, self.perturber, engine)  # es.member_batch: one batch per group
        built = build_objective(cfg, dims, path, model=self.model, engine=engine,
                                tokenizer=getattr(engine, "tokenizer", None), members=self.members)
        # the episode engine (None: no episodes); the prompt optimiser's side (prompt.*)
        self.objective, self.engine, self.context, self.tokenizer = built.objective, built.engine, built.context, \
            built.tokenizer
        self.sigma = _schedule(es.sigma, es.steps)
        self.alpha = _schedule(es.alpha, es.steps)
        self.identity = config_identity(cfg, path)
        self.config_hash = self.identity["hash"]
        self.ledger = Ledger(cfg.run.dir, self.config_hash, dims.rank)
        self.ckpt = Checkpointer(cfg.run.dir, dims, cfg.run.keep_checkpoints, cfg.run.checkpoint_async, self.identity)
        self.restored_from = 0  # step of the checkpoint the resume loaded (0: none)
        self.start_step = self._resume()
        write_config(cfg, dims.rank, path, self.identity)
        self.health = Health(cfg.run.degenerate_steps, cfg.run.stop_on_degenerate)
        log.info("ES on %d local parameters in %d tensors (%s restore, master %s), starting at step %d",
                 self.perturber.numel, len(self.shards), es.restore, es.master, self.start_step)

    # ------------------------------------------------------------------ build
    def _resume(self) -> int:
        """:meth:`_restore`, with one verdict for all ranks: a rank that fails alone (a checkpoint that cannot map
        onto its boxes, a read error with no older checkpoint) makes every rank raise the same line at once."""
        start, err = 0, None
        try:
            start = self._restore()
        except Exception as e:  # noqa: BLE001 (agreed on, then raised on every rank)
            err = e
        agree_on_failure(self.dims, err, "resuming the run")
        return start

    def _restore(self) -> int:
        try:
            entries = self.ledger.repair()  # raises if run.dir holds another config's ledger; cuts a torn tail
        except LedgerError as e:
            raise LedgerError(f"{e}{self._what_differs()}") from None
        self._updates = updates_digest(entries)  # extended every step; checkpoints record it
        if self.context is not None:  # the context after the last step, from run.dir/contexts (none: the initial)
            self.context.restore(entries)
        if not entries:
            return 0
        done = self.restored_from = restore_run_(self.cfg.run.dir, self.perturber, self.dims, entries,
                                                 identity=self.identity,
                                                 exact_restore=exact_restore(self.cfg.es.restore, self.cfg.es.master))
        log.info("resumed: checkpoint after step %d, replayed %d ledger entries", done, len(entries) - done)
        return len(entries)

    def _what_differs(self) -> str:
        """'; it differs in: ...' from the identity the run's config.json recorded ('' if none is recorded)."""
        what = recorded_difference(self.cfg.run.dir, self.identity["fields"])
        return f"; it differs in: {what}" if what else ""

    # ------------------------------------------------------------------ run
    @property
    def steps(self) -> int:
        return self.cfg.es.steps

    @property
    def comm_stats(self) -> CommStats:
        """Bytes this trainer's collectives moved (counted at the calls, TP channel included)."""
        return self.dims.comm.stats - self._comm0

    def evaluate(self) -> float:
        """Held-out return with the unperturbed weights (sigma = 0); agent objectives' Mean@k/Pass@k to metrics."""
        return self.metrics.held_out(self.objective.evaluate_held_out())

    def step(self, t: int) -> dict:
        es, dims = self.cfg.es, self.dims
        t0 = time.perf_counter()
        seeds, signs = population(self.cfg.run.seed, t, es.population, es.mirrored)
        es_on = self.context is None or self.context.es_on(t)  # prompt.mode: steps without ES keep the weights
        sigma, alpha = (self.sigma(t), self.alpha(t)) if es_on else (0.0, 0.0)
        if sigma == 0.0:  # no perturbation: the returns differ by sampling noise only, an update is a random walk
            alpha = 0.0  # recorded so, and replay applies nothing
        local = {}
        perturb_s = restore_s = 0.0  # ES's own cost inside the step, beside the rollouts (tools/bench.py)
        perturbed = es_on and sigma > 0.0  # sigma 0 would change nothing
        # a subtract restore leaves its rounding in the weights: every rank applies every member's perturb/restore in
        # member order (other dp groups' as noise passes only), so replicas, layouts and replay agree bit for bit
        passes = perturbed and not exact_restore(es.restore, es.master)
        batched = perturbed and self.members is not None  # the group's members in one batch, the weights untouched
        if batched:
            mine = dims.members(es.population)
            local, perturb_s = self._evaluate_batch([Member(t, m, seeds[m], signs[m], m // 2 if es.mirrored else m)
                                                     for m in mine], sigma)
            self.members.rows = None
        queue = None if batched else MemberQueue(dims, es.population, self.cfg.parallel.schedule)
        done = -1  # the last member whose perturbation this rank applied (or passed over)
        bar = tqdm(total=es.population, desc=f"step {t} members", leave=False,
                   disable=dims.rank != 0 or es.population < 4 or not interactive())
        for m in [] if batched else itertools.chain(queue, [es.population]):  # claimed members; then the end
            t1 = time.perf_counter()
            for k in range(done + 1, m) if passes else ():  # other groups' members before m: noise passes
                self.perturber.perturb(seeds[k], sigma, signs[k])
                self.perturber.restore()
            done = m
            if m == es.population:
                perturb_s += _since(t1)
                break
            if perturbed:
                self.perturber.perturb(seeds[m], sigma, signs[m])
            perturb_s += _since(t1)
            try:
                local[m] = self._evaluate(Member(t, m, seeds[m], signs[m], m // 2 if es.mirrored else m))
            finally:
                t1 = time.perf_counter()
                if perturbed:
                    self.perturber.restore()
                restore_s += _since(t1)
            bar.update(1)
        bar.close()
        t_eval = time.perf_counter()
        returns = gather_returns(local, es.population, dims)
        if queue is not None:
            queue.close()
        failures, retries = self._episode_failures()
        weights = shape_returns(returns, es.shaping) if es_on else [0.0] * es.population  # zeros: no-op update
        t1 = time.perf_counter()
        if alpha > 0.0:
            if self._host_weights:  # the rollouts' freed heap back to the system before the update's fp32 chunk
                malloc_trim()
            self.perturber.update(seeds, signs, weights, alpha, es.weight_decay,  # the default's call unchanged
                                  **({"decay_to": es.decay_to} if es.decay_to != "zero" else {}))
        update_s = _since(t1)
        if self.cfg.parallel.checksum_every and (t + 1) % self.cfg.parallel.checksum_every == 0:
            check_replicas([(s.info.name, s.tensor) for s in self.shards], dims)
        ok = [float(r) for r in returns if not math.isnan(r)]
        record = {
            "step": t, "seeds": seeds, "signs": signs,
            "returns": [None if math.isnan(r) else float(r) for r in returns],
            "weights": [float(w) for w in weights], "sigma": sigma, "alpha": alpha, "weight_decay": es.weight_decay,
            "wall_time": time.time(),
        }
        if es.decay_to != "zero":  # the default's records stay as they were
            record["decay_to"] = es.decay_to
        if failures is not None:  # failed episodes by kind: the model's (scored as losses) and the infrastructure's
            record["failures"] = failures
            record["retries"] = retries  # played again: episodes after an infrastructure failure, members all failed
        if self.context is not None:  # context played, context after the step, programs evaluated
            record.update(self.context.step(t, self._step_trajectories()))
        self.ledger.append(record)
        updates_digest([record], self._updates)
        if es_on:
            self.health.check(t, returns, weights, self.objective.recent_errors)
        return {"step": t, "sigma": sigma, "alpha": alpha,
                "return_mean": sum(ok) / len(ok) if ok else math.nan, "return_max": max(ok) if ok else math.nan,
                "failed": es.population - len(ok), **({"episodes_failed": failures} if failures else {}),
                **({"retried": retries} if retries and any(retries.values()) else {}),
                "rollout_s": t_eval - t0, "step_s": time.perf_counter() - t0,
                "perturb_s": perturb_s, "restore_s": restore_s, "update_s": update_s,
                "comm_bytes_total": self.comm_stats.total,
                **({"context": record["context_next"], "programs": record["programs"]} if self.context else {})}

    def _evaluate(self, member: Member) -> float:
        """The member's return (NaN: it failed; an episodic objective has played again what the infrastructure
        failed, the whole member if every episode failed so)."""
        try:
            return self.objective.evaluate_member(member)
        except StartupError:
            raise  # the objective cannot be played here (a harness that never calls its endpoint): every rank
        except Exception as e:
            if self.dims.tp > 1:
                raise  # a peer may be waiting inside a collective: fail loudly rather than hang
            log.exception("member %d of step %d failed; its return counts as NaN", member.index, member.step)
            self.health.note_error(f"member {member.index}: {type(e).__name__}: {e}")
            return math.nan

    def _evaluate_batch(self, members: list[Member], sigma: float) -> tuple[dict[int, float], float]:
        """The returns of ``members`` played in one batch (:meth:`_evaluate`'s rules: a failure is NaN for all), and
        the seconds their factors took."""
        t0 = time.perf_counter()
        try:
            self.members.set_members([m.seed for m in members], [m.sign for m in members], sigma)
            made = _since(t0)
            return self.objective.evaluate_members(members, batched=True), made
        except StartupError:
            raise
        except Exception as e:
            if self.dims.tp > 1:
                raise  # a peer may be waiting inside a collective: fail loudly rather than hang
            log.exception("the batch of members %s of step %d failed; their returns count as NaN",
                          [m.index for m in members], members[0].step)
            self.health.note_error(f"members {[m.index for m in members]}: {type(e).__name__}: {e}")
            return {m.index: math.nan for m in members}, 0.0

    def _episode_failures(self) -> tuple[dict | None, dict | None]:
        """The step's failed training episodes by kind and what was played again (episodes after an infrastructure
        failure, members all of whose episodes failed so), summed over every rank (one small all-reduce); (None,
        None) for objectives that play no episodes."""
        mine = self.objective.take_failures()
        if mine is None:
            return None, None
        again = list(self.objective.take_retried())
        counts = self.dims.comm.all_reduce(torch.tensor(mine + again, dtype=torch.float64), "sum", "world")
        counts = [int(c) for c in counts.tolist()]
        return dict(zip(FAILURE_KINDS, counts)), dict(zip(("episodes", "members"), counts[len(FAILURE_KINDS):]))

    def _step_trajectories(self) -> list:
        """All dp groups' training trajectories of this step, on every rank, in member order (as one group
        plays them): the prompt optimiser then takes the same decision on every rank, at any layout."""
        mine = self.objective.take_trajectories()  # TP leaders hold their group's; peers hold none
        gathered = [tr for part in self.dims.comm.all_gather_object(mine) for tr in part]
        return sorted(gathered, key=lambda tr: tr.member)  # stable: a member's episodes keep their order

    def save(self, step: int) -> str:
        """Start saving the weights after ``step`` steps, tied to the ledger's updates (finished by poll/wait)."""
        return self.ckpt.save(step, self.perturber, self._updates.hexdigest()[:16])

    def poll(self) -> None:
        self.ckpt.poll()

    def wait(self) -> None:
        self.ckpt.wait()

    def finish(self) -> dict:
        """``run.export``: run.dir/export, a plain HF directory of the final weights; the summary's own fields."""
        cfg, dims = self.cfg, self.dims
        if cfg.run.export:
            out = os.path.join(cfg.run.dir, "export")
            if self.model is not None:
                export_hf(self.model, self.tokenizer, out, dims)
            else:  # vllm: the final checkpoint's canonical boxes, in the base model's HF layout, written by rank 0
                done = checkpoint_steps(cfg.run.dir, cfg.es.steps)
                if not done or done[-1][0] != cfg.es.steps:  # e.g. a rerun of a finished run with a lost checkpoint
                    self.save(cfg.es.steps)
                    self.wait()
                    done = checkpoint_steps(cfg.run.dir, cfg.es.steps)
                if dims.rank == 0:
                    export_checkpoint(done[-1][1], self.base_path, out, getattr(torch, cfg.model.dtype))
            dims.comm.barrier()
        return {"params_local": self.perturber.numel}

    def close(self) -> None:
        if getattr(self, "ckpt", None) is not None:
            self.ckpt.close()  # normal ends waited already; on an error path an unfinished save stays a leftover
        if getattr(getattr(self, "objective", None), "close", None) is not None:  # a harness's endpoint server
            self.objective.close()
        if getattr(self, "engine", None) is not None:  # vllm: shut down before the launcher's process groups go
            self.engine.close()
        if getattr(self, "members", None) is not None:  # es.member_batch: the model's own forwards back
            self.members.close()
        self.metrics.close()
        self.model = None
        self.perturber = None
