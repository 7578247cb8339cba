"""ES objective over agent episodes: a member's return is its mean episode return.

Every member of a step plays the same tasks (common random numbers, drawn from
the run's ``tasks`` stream); token sampling uses the ``episode`` stream. The TP
leader of each dp group plays the episodes; its peers join the forward passes.
Held-out evaluation plays every eval task ``eval_repeats`` (k) times with the
unperturbed weights, spread over the dp groups, each sample seeded by
(question, sample) only: the same streams at every evaluation and across a resume
(common random numbers: before and after are comparable); all-reduces give every rank the Mean@k (mean return) and
Pass@k (per question the best of k) that one group playing all would get; a
failed held-out episode scores its environment's failure return there. In training, an episode the model failed
(an environment error its text caused, its wall clock) scores the environment's
failure return; only an infrastructure fault is NaN and left out of the member's
mean. Each kind is counted (:meth:`AgentObjective.take_failures`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch

from esopt_mp.agent.loop import (AgentConfig, build_agent_config, follow_episodes, generate_texts, run_episodes,
                                  write_trajectories)
from esopt_mp.engine.hf import HFEngine
from esopt_mp.engine.sampling import SamplingParams
from esopt_mp.envs import FAILURE_KINDS, StartupError
from esopt_mp.es.seeds import stream_seed

log = logging.getLogger(__name__)


def load_tasks(cfg) -> tuple[list[dict], list[dict]]:
    """(train, eval) tasks of the configured environment (``cfg``: the ``env`` section), from its spec."""
    return cfg.spec.splits(cfg, cfg.section)


class AgentObjective:
    def __init__(self, env_cfg, engine_cfg, run_seed: int, model, tokenizer, dims, traj_path: str | None = None,
                 engine=None):
        """``engine``: a built engine (vllm); by default an hf engine on ``model``."""
        self.cfg, self.run_seed, self.dims = env_cfg, run_seed, dims
        self.engine = engine or HFEngine(model, tokenizer, prefix_reuse=engine_cfg.prefix_reuse)
        self.spec, self.section = env_cfg.spec, env_cfg.section
        if dims.is_tp_leader:  # the sandbox, a browser stack, a server: refused now, not at episode 1
            try:
                self.spec.check(self.section, env_cfg, first=dims.dp_rank == 0)
            except Exception as e:  # noqa: BLE001 - whatever the env's check raised, said in one place
                raise StartupError(f"env.name={env_cfg.name}: the start-up check failed on rank {dims.rank}: "
                                   f"{type(e).__name__}: {e}") from e
        if self.spec.syncs_after_check(self.section):  # the first's check reset shared state: nobody plays before
            dims.comm.barrier()
        self.train_cfg = build_agent_config(env_cfg, SamplingParams.of(engine_cfg))
        self.eval_cfg = build_agent_config(env_cfg, SamplingParams.of(engine_cfg, env_cfg.eval_temperature))
        try:
            self.train_tasks, self.eval_tasks = load_tasks(env_cfg)
        except (ValueError, OSError) as e:  # too few tasks, a bad task file, a task source that failed: one line
            raise StartupError(f"env.name={env_cfg.name}: its tasks: {e}") from e
        self.traj_path = traj_path if traj_path and dims.rank == 0 else None
        self.eval_round = 0  # evaluations this process ran: a trajectory tag only, never a seed (not checkpointed)
        self.recent_errors: list[str] = []  # a few errors of the last episodes this rank played (health warnings)
        self.last_eval: dict = {}  # the last held-out evaluation: Mean@k, Pass@k, thresholded accuracy
        self.context = None  # a context run (esopt_mp/prompt/run.py): its render(seed, slot) joins each system prompt
        self.trajectories: list = []  # the training episodes of the current step, for the context optimiser
        self.failures: Counter = Counter()  # failed training episodes this rank played, by kind, since the last take

    def _play(self, tasks, seeds, cfg, render=None, failed_count=False, **tags) -> tuple[float, int]:
        """(sum, count) of the finite episode returns on the TP leader; (0, 0) on its peers. ``failed_count``:
        an infrastructure-failed episode (NaN) scores its env's failure return instead of being left out
        (comparisons where failing must cost)."""
        if not self.dims.is_tp_leader:
            self._follow(len(tasks), cfg)
            return 0.0, 0
        eps = self.play(tasks, seeds, cfg, render=render, **tags)
        rets = [e.floor if math.isnan(e.ret) else e.ret for e in eps] if failed_count else \
            [e.ret for e in eps if not math.isnan(e.ret)]
        return sum(rets), len(rets)

    def play(self, tasks, seeds, cfg, render=None, slots=None, ctx_seeds=None, **tags) -> list:
        """The TP leader's episodes of ``tasks`` (one per seed), logged to the trajectories file.

        ``render``: (seed, slot) -> the context text of that episode, instead of the context run's current one (a
        candidate skill under validation); ``tags["context"]`` then names it in the trajectories file. ``slots``:
        each episode's place in the whole set it belongs to, the same at every layout (training: step + pair *
        episodes_per_step + episode; held-out: its global index; default: its index here); ``ctx_seeds``: the
        seed each episode's context is rendered with (default: its episode seed).
        """
        if render is None and self.context is not None:
            render = self.context.render
        envs = [self._make_env(self.cfg.max_turns) for _ in tasks]
        # an environment may cap the episodes played at once (one browser each, say)
        group = self._group(len(tasks))
        slots = list(range(len(tasks))) if slots is None else list(slots)
        ctx_seeds = list(seeds) if ctx_seeds is None else list(ctx_seeds)
        eps = []
        try:
            for a in range(0, len(tasks), group):
                b = a + group
                ctx = [render(s, k) for s, k in zip(ctx_seeds[a:b], slots[a:b])] if render is not None else None
                eps += run_episodes(self.engine, envs[a:b], tasks[a:b], seeds[a:b], cfg, self.dims, ctx)
        finally:
            for env in envs:  # an episode the loop abandoned (its wall clock) still holds its browser
                getattr(env, "close", lambda: None)()
        if self.traj_path:
            extra = {"context": self.context.hash} if self.context is not None and "context" not in tags else {}
            write_trajectories(self.traj_path, eps, **tags, **extra)
        if self.context is not None and tags.get("kind") == "train":
            from esopt_mp.prompt import Trajectory

            extract = self.spec.program_extractor()  # the env's own extraction: the program it evaluated
            self.trajectories += [Trajectory.from_turns(e.ret, e.turns, tags.get("member", -1), extract, k,
                                                        tags.get("step", -1)) for k, e in zip(slots, eps)]
        self.recent_errors = [f"episode {e.id}: {e.error}" for e in eps if e.error][:3]
        if tags.get("kind") == "train":
            self.failures.update(e.failure for e in eps if e.failure)
        return eps

    def take_failures(self) -> list[int]:
        """Failed training episodes this rank played since the last call, per kind of ``FAILURE_KINDS``."""
        counts, self.failures = self.failures, Counter()
        return [counts[k] for k in FAILURE_KINDS]

    def _make_env(self, max_turns: int):
        """A fresh environment of ``env.name`` built from its section (each episode gets its own)."""
        return self.spec.build(self.section, max_turns=max_turns, sandbox=self.cfg.sandbox)

    def _follow(self, n: int, cfg) -> None:
        """A TP peer's side of :meth:`play` for ``n`` episodes: one follow per batch the leader plays."""
        for _ in range(-(-n // self._group(n))):
            follow_episodes(self.engine, cfg, self.dims)

    def _group(self, n: int) -> int:
        """Episodes played at once: all, or the environment's cap (``EnvSpec.max_concurrent``)."""
        cap = self.spec.max_concurrent(self.section)
        return max(1, min(n, cap) if cap else n)

    def step_tasks(self, step: int) -> list[dict]:
        """The step's training tasks; with ``fixed_task`` (program search) the first training task every time, so
        every program of the run, and the seed's, is scored on the same instances, as EoH does."""
        if getattr(self, "fixed_task", False):
            return [self.train_tasks[0]] * self.cfg.episodes_per_step
        rng = random.Random(stream_seed(self.run_seed, "tasks", step))
        return [self.train_tasks[i] for i in rng.sample(range(len(self.train_tasks)), self.cfg.episodes_per_step)]

    def score_program(self, code: str, step: int = 0) -> float | None:
        """Mean score of ``code`` over step ``step``'s tasks, evaluated as an episode's reply is (same environment,
        same sandbox); None if it fails on any. No model runs: the seed program's fitness, outside the budget."""
        scores = []
        for task in self.step_tasks(step):
            env = self._make_env(1)
            try:
                env.reset(task)
                info = env.step(f"```python\n{code.rstrip()}\n```")[4]
            finally:  # an env holding a sandbox or a browser is closed also when it raised, as _play does
                getattr(env, "close", lambda: None)()
            if info.get("error") is not None or info.get("score") is None:
                return None
            scores.append(float(info["score"]))
        return sum(scores) / len(scores)

    def evaluate(self, model, member) -> float:
        if member is None:
            return self._held_out()
        tasks = self.step_tasks(member.step)
        seeds = [stream_seed(self.run_seed, "episode", member.step, member.index, e) for e in range(len(tasks))]
        # a context optimiser shares the step's episodes out by slot: consecutive within the step (EoH: every
        # operator equally often, +-1) and shifted by the step (an operator the step has too few slots for runs at
        # later steps); both members of a mirrored pair play the same slots and contexts (operator and parents),
        # their token sampling differs as any two members' does
        slots = [member.step + member.pair * len(tasks) + e for e in range(len(tasks))]
        ctx_seeds = [stream_seed(self.run_seed, "context", member.step, k) for k in slots]
        total, n = self._play(tasks, seeds, self.train_cfg, slots=slots, ctx_seeds=ctx_seeds, kind="train",
                              step=member.step, member=member.index)
        return total / n if n else math.nan

    def _held_out(self) -> float:
        """Mean@k on every rank (k = ``eval_repeats`` samples per held-out question); Pass@k in ``last_eval``.

        Sample s of question q is seeded by (q, s), whichever dp group plays it and whichever evaluation this
        is: group g plays the episodes g, g + dp, ... of the question-major list. A failed episode -- the model's
        error, its wall clock, or an infrastructure fault -- scores the environment's failure return (0; a
        design problem's failure score): a failure is not an answer. It is counted in ``failed``, by kind in
        ``failures``. Two all-reduces: (sum, count, above half, failures by kind) and, per question, the best
        return (Pass@k: the mean over questions of the best of k).
        """
        r, k, n = self.eval_round, self.cfg.eval_repeats, len(self.eval_tasks)
        self.eval_round += 1
        mine = list(range(self.dims.dp_rank, n * k, self.dims.dp))
        seeds = [stream_seed(self.run_seed, "eval", e // k, e % k) for e in mine]
        if self.dims.is_tp_leader:
            eps = self.play([self.eval_tasks[e // k] for e in mine], seeds, self.eval_cfg, slots=mine, kind="eval",
                            round=r)
            kinds = Counter(ep.failure for ep in eps if ep.failure)
            rets = [(e // k, ep.floor if math.isnan(ep.ret) else ep.ret) for e, ep in zip(mine, eps)]
        else:  # one follow per batch of the environment's cap of episodes the leader plays
            self._follow(len(mine), self.eval_cfg)
            rets, kinds = [], Counter()
        best = torch.full((n,), -math.inf, dtype=torch.float64)
        for q, ret in rets:
            best[q] = max(best[q].item(), ret)
        stats = torch.tensor([sum(x for _, x in rets), len(rets), sum(x > 0.5 for _, x in rets),
                              *(kinds[f] for f in FAILURE_KINDS)], dtype=torch.float64)
        total, count, above, *kinds = self.dims.comm.all_reduce(stats, "sum", "world").tolist()
        best = self.dims.comm.all_reduce(best, "max", "world")
        played = best[best > -math.inf]
        mean = total / count if count else math.nan
        self.last_eval = {"k": k, "questions": n, f"mean@{k}": mean,
                          f"pass@{k}": played.mean().item() if len(played) else math.nan,
                          "above_half": above / count if count else math.nan,  # thresholded accuracy (ANLS > 0.5)
                          "failed": int(sum(kinds)),  # episodes that scored 0 (or the failure return): failed
                          "failures": {f: int(c) for f, c in zip(FAILURE_KINDS, kinds)}}
        return mean

    def skill_hooks(self, cfg) -> dict:
        """``proposer(prompt, step, batch)`` and ``validate(text, step, steps)`` for prompt.optimiser=skill (``cfg``:
        the prompt.skill section), both on the run's unperturbed model: the trainer updates the context after every
        member restored its weights.

        The proposal is made once, by dp group 0 (policy: its TP leader with its peers following) or rank 0
        (endpoint), sampled with the seed (run seed, step, batch), and broadcast: every rank merges the same edits.
        If the policy's generation raises on the leader before the sharded forward (a tokenizer error; at tp=1 any
        error), its TP peers are released from their follow (:func:`generate_texts` ends it) and an error marker is
        broadcast instead of the texts, so every rank raises the same error at once rather than waiting out
        ``parallel.timeout_s``; a failure inside the sharded forward at tp > 1 leaves the peers in it.
        """
        endpoint = None
        if cfg.proposer == "endpoint":
            from esopt_mp.prompt.proposers import EndpointProposer

            endpoint = EndpointProposer(cfg.url, cfg.model, cfg.key_env, cfg.max_new_tokens, cfg.temperature,
                                        cfg.timeout_s)
        sampling = dataclasses.replace(self.train_cfg.sampling, max_new_tokens=cfg.max_new_tokens,
                                       temperature=cfg.temperature, stop=())
        dims = self.dims

        def ask(prompts: list[str], step: int, batches: list[int]) -> list[str]:
            """Batch b's proposal for its prompt, all at once: one generation batch, or concurrent requests."""
            seeds = [stream_seed(self.run_seed, "skill", step, b) for b in batches]
            texts, mine = None, None
            try:
                if endpoint is not None and dims.rank == 0:
                    with ThreadPoolExecutor(max_workers=min(8, len(prompts))) as pool:
                        texts = list(pool.map(lambda a: _ask(endpoint, *a, step), zip(prompts, seeds, batches)))
                elif endpoint is None and dims.dp_rank == 0:
                    if dims.is_tp_leader:
                        texts = generate_texts(self.engine, [[{"role": "user", "content": p}] for p in prompts],
                                               seeds, sampling, dims)
                    else:
                        follow_episodes(self.engine, AgentConfig(sampling=sampling), dims)
            except Exception as e:  # on rank 0 the marker replaces the texts; any rank still joins the broadcast
                log.exception("skill proposal of step %d failed on rank %d", step, dims.rank)
                texts = mine = {"error": f"{type(e).__name__}: {e}", "rank": dims.rank}
            got = dims.comm.broadcast_object(texts, src=0, dim="world")
            failed = got if isinstance(got, dict) else mine
            if failed is not None:
                raise RuntimeError(f"prompt.skill.proposer={cfg.proposer}: the proposal of step {step} failed on "
                                   f"rank {failed['rank']}: {failed['error']}")
            return got

        return {"proposer": Proposer(ask),
                "validate": lambda text, step, steps=(): self.validate_context(text, step, cfg.val_tasks, steps)}

    def validate_context(self, text: str, step: int, n: int, steps=()) -> float:
        """Mean return of ``n`` training tasks that neither ``step`` nor ``steps`` played (every step whose
        trajectories the proposer read; fewer left: any), played with ``text`` as the context; seeds from (run
        seed, step), so two contexts validated at one step meet the same episodes.
        The episodes are spread over the dp groups and summed (one all-reduce), like held-out evaluation; a failed
        episode scores its environment's failure return, as there."""
        from esopt_mp.prompt import context_hash

        played = {id(t) for s in {step, *steps} for t in self.step_tasks(s)}
        rest = [t for t in self.train_tasks if id(t) not in played]
        pool = rest if len(rest) >= n else self.train_tasks
        if pool is not rest:
            log.warning("step %d: only %d training tasks were not played by the steps the proposer read, fewer than "
                        "prompt.skill.val_tasks=%d: the held-out mini-batch is drawn from all %d (raise env.n_train)",
                        step, len(rest), n, len(self.train_tasks))
        rng = random.Random(stream_seed(self.run_seed, "skill_val", step))
        tasks = [pool[i] for i in rng.sample(range(len(pool)), min(n, len(pool)))]
        seeds = [stream_seed(self.run_seed, "skill_val", step, i + 1) for i in range(len(tasks))]
        mine = list(range(self.dims.dp_rank, len(tasks), self.dims.dp))
        total, count = 0.0, 0
        if mine:
            total, count = self._play([tasks[i] for i in mine], [seeds[i] for i in mine], self.eval_cfg,
                                      render=lambda s, slot: text, failed_count=True, kind="skill_val", step=step,
                                      context=context_hash(text))  # a skill that makes episodes fail must lose
        stats = self.dims.comm.all_reduce(torch.tensor([total, count], dtype=torch.float64), "sum", "world")
        return stats[0].item() / stats[1].item() if stats[1].item() else math.nan


class Proposer:
    """``proposer(prompt, step, batch)`` for one batch, ``proposer.many(prompts, step)`` for all of a step's
    batches in one go (skill synthesis prefers it: one generation batch instead of one per batch)."""

    def __init__(self, ask):
        self.ask = ask

    def __call__(self, prompt: str, step: int, batch: int) -> str:
        return self.ask([prompt], step, [batch])[0]

    def many(self, prompts: list[str], step: int) -> list[str]:
        return self.ask(prompts, step, list(range(len(prompts))))


def _ask(endpoint, prompt: str, seed: int, batch: int, step: int) -> str:
    """An endpoint's proposal; a failed request becomes a proposal without edits (dropped with its reason)."""
    try:
        return endpoint(prompt, seed)
    except Exception as e:
        log.warning("prompt.skill.url: proposal of step %d batch %d failed: %s", step, batch, e)
        return f"(endpoint error: {type(e).__name__}: {e})"
