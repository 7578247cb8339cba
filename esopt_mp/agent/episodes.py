"""Playing a run's episodes: its environments, tasks, trajectories file and failed episodes.

Every trainer (ES, GRPO, PPO) plays through one :class:`EpisodePlayer`: it checks the environment at start-up,
loads the tasks, draws a step's tasks from the run's ``tasks`` stream, builds a fresh environment per episode
(:meth:`EpisodePlayer.make_env`, the one place a test swaps the environment), plays them in batches of the
environment's cap, appends them to the trajectories file and counts the failed training episodes by kind. At
tp > 1 the TP leader plays, inside its engine's ``lead``; its peers follow and get no episodes.

The ES objective over them (:class:`AgentObjective`): a member's return is its mean episode return. Every member
of a step plays the same tasks (common random numbers, drawn from the run's ``tasks`` stream); token sampling
uses the ``episode`` stream (``common_episode`` with ``env.common_draws``: every member alike). An episode the
model failed (an environment error its text caused, its wall clock) scores the environment's failure return; only
an infrastructure fault is NaN and left out of the member's mean. Each kind is counted
(:meth:`AgentObjective.take_failures`); held-out evaluation is :class:`esopt_mp.agent.held_out.HeldOut`'s.
"""
from __future__ import annotations

import logging
import math
import random
from collections import Counter

from esopt_mp.agent.held_out import HeldOut
from esopt_mp.agent.loop import build_agent_config, run_episodes, write_trajectories
from esopt_mp.core.errors import FAILURE_KINDS, InfraError, StartupError
from esopt_mp.engine.base import Engine, SamplingParams
from esopt_mp.engine.tp import replicated
from esopt_mp.es.seeds import stream_seed

log = logging.getLogger(__name__)


def load_tasks(cfg) -> tuple[list[dict], list[dict]]:
    """(train, eval) tasks of the configured environment (``cfg``: the ``env`` section), from its spec."""
    return cfg.spec.splits(cfg, cfg.section)


class EpisodeTally:
    """What a player keeps of the episodes it played: a few recent errors (health warnings), the failed training
    episodes by kind and the training episodes played again since the last :meth:`take_failures` (both players:
    the environment's and the harness's, each with ``step_tasks(step)`` and ``run_seed``)."""

    def __init__(self):
        self.recent_errors: list[str] = []
        self.failures: Counter = Counter()
        self.retried = 0  # training episodes played again after an infrastructure failure
        self.reevaluated = 0  # members whose every episode failed so, evaluated again

    def member_episodes(self, member) -> tuple[list[dict], list[int]]:
        """(tasks, sampling seeds) of member ``member``'s training episodes: the step's tasks, every member alike
        (common random numbers), and one ``episode`` stream seed per (step, member, episode), or with
        ``env.common_draws`` one ``common_episode`` seed per (step, episode) for every member."""
        tasks = self.step_tasks(member.step)
        if self.cfg.common_draws:
            return tasks, [stream_seed(self.run_seed, "common_episode", member.step, e) for e in range(len(tasks))]
        return tasks, [stream_seed(self.run_seed, "episode", member.step, member.index, e) for e in range(len(tasks))]

    def play_retrying(self, attempt, n: int, kind=None, groups: list[list[int]] | None = None) -> list:
        """``attempt(indices)``: the episodes of those of the ``n`` tasks. An episode the infrastructure failed (a
        site down, a sandbox that would not start) is played once more, same task and seed; the second attempt
        counts, whatever it gives, and carries the first one's error. Training episodes all of which still failed
        so (the member would be dropped) are played once more as a whole: the member is evaluated again, and only
        that evaluation's episodes count (are tallied, written, returned). ``groups``: the episodes of each member
        when several members play in one batch (default: all ``n`` are one member's)."""
        eps = attempt(list(range(n)))
        again = [i for i, e in enumerate(eps) if e.failure == "infra"]
        if again:
            log.warning("%d of %d episodes failed for infrastructure reasons; playing them once more (first: %s)",
                        len(again), n, eps[again[0]].error)
            for i, ep in zip(again, attempt(again)):
                ep.retried = eps[i].error or "infra"
                eps[i] = ep
            if kind == "train":
                self.retried += len(again)
        for group in (groups if groups is not None else [list(range(n))]) if kind == "train" else ():
            if not group or not all(eps[i].failure == "infra" for i in group):
                continue
            log.warning("every episode of the member failed for infrastructure reasons (%s); evaluating it once "
                        "more", eps[group[0]].error)
            for i, ep in zip(group, attempt(group)):
                ep.retried = f"the member was evaluated again: {eps[i].error or 'infra'}"
                eps[i] = ep
            self.reevaluated += 1
        return eps

    def tally(self, eps, kind) -> None:
        self.recent_errors = [f"episode {e.id}: {e.error}" for e in eps if e.error][:3]
        if kind == "train":
            self.failures.update(e.failure for e in eps if e.failure)

    def take_failures(self) -> list[int]:
        """Failed training episodes this rank played since the last call, per kind of ``FAILURE_KINDS``."""
        counts, self.failures = self.failures, Counter()
        return [counts[k] for k in FAILURE_KINDS]

    def take_retried(self) -> list[int]:
        """[training episodes played again after an infrastructure failure, members evaluated again because every
        episode failed so] on this rank since the last call."""
        out = [self.retried, self.reevaluated]
        self.retried = self.reevaluated = 0
        return out


class EpisodePlayer(EpisodeTally):
    def __init__(self, env_cfg, engine_cfg, run_seed: int, engine: Engine, dims, traj_path: str | None = None,
                 fixed_task: bool = False):
        """``engine``: any engine (wrapped for ``dims``' tp group here); ``traj_path``: the trajectories file (rank 0
        writes it); ``fixed_task`` (program search): every step plays the first training task, so every program
        of the run, and the seed's, is scored on the same instances, as EoH does."""
        self.cfg, self.run_seed, self.dims, self.fixed_task = env_cfg, run_seed, dims, fixed_task
        self.engine = replicated(engine, dims)
        self.spec, self.section = env_cfg.spec, env_cfg.section
        if dims.is_tp_leader:  # the sandbox, a browser stack, a server: refused now, not at episode 1
            try:
                self.spec.check(self.section, env_cfg, first=dims.dp_rank == 0)
            except Exception as e:  # noqa: BLE001 - whatever the env's check raised, said in one place
                raise StartupError(f"env.name={env_cfg.name}: the start-up check failed on rank {dims.rank}: "
                                   f"{type(e).__name__}: {e}") from e
        self.max_concurrent = self.spec.max_concurrent(self.section)  # the environment's cap (0: none), asked once
        if self.spec.syncs_after_check(self.section):  # the first's check reset shared state: nobody plays before
            dims.comm.barrier()
        self.train_cfg = build_agent_config(env_cfg, SamplingParams.of(engine_cfg))
        self.eval_cfg = build_agent_config(env_cfg, SamplingParams.of(engine_cfg, env_cfg.eval_temperature))
        try:
            self.train_tasks, self.eval_tasks = load_tasks(env_cfg)
        except (ValueError, OSError) as e:  # too few tasks, a bad task file, a task source that failed: one line
            raise StartupError(f"env.name={env_cfg.name}: its tasks: {e}") from e
        except Exception as e:  # noqa: BLE001 - an environment's own task code raised: one line, not a traceback
            raise StartupError(f"env.name={env_cfg.name}: its tasks: {type(e).__name__}: {e}") from e
        self.traj_path = traj_path if traj_path and dims.rank == 0 else None
        EpisodeTally.__init__(self)

    def play(self, tasks, seeds, cfg, render=None, slots=None, ctx_seeds=None, members=None, **tags) -> list:
        """The episodes of ``tasks`` (one per seed) on the TP leader, logged to the trajectories file; [] on its
        peers, which follow the leader's generations meanwhile.

        ``render``: (seed, slot) -> the context text of that episode (a context run's, or a candidate skill under
        validation; ``tags["context"]`` names it in the trajectories file). ``slots``: each episode's place in the
        whole set it belongs to, the same at every layout (training: step + pair * episodes_per_step + episode;
        held-out: its global index; default: its index here); ``ctx_seeds``: the seed each episode's context is
        rendered with (default: its episode seed). ``tags["kind"] == "train"``: failed episodes are counted.
        ``members``: each episode's member slot when several members play in one batch (es.member_batch); then
        ``tags["member"]`` lists the member index of each slot.
        """
        return self.engine.lead(lambda: self._play(tasks, seeds, cfg, render, slots, ctx_seeds, members, tags),
                                cfg.sampling, default=[])

    def _play(self, tasks, seeds, cfg, render, slots, ctx_seeds, members, tags) -> list:
        slots = list(range(len(tasks))) if slots is None else list(slots)
        ctx_seeds = list(seeds) if ctx_seeds is None else list(ctx_seeds)

        def attempt(idx):
            return self._attempt([tasks[i] for i in idx], [seeds[i] for i in idx], cfg, render,
                                 [slots[i] for i in idx], [ctx_seeds[i] for i in idx],
                                 None if members is None else [members[i] for i in idx])

        groups = None if members is None else \
            [[i for i, m in enumerate(members) if m == s] for s in dict.fromkeys(members)]
        eps = self.play_retrying(attempt, len(tasks), tags.get("kind"), groups)
        if self.traj_path:
            for group in groups or [list(range(len(eps)))]:  # a member's episodes under its own index
                member = {} if members is None else {"member": tags["member"][members[group[0]]]}
                write_trajectories(self.traj_path, [eps[i] for i in group], **{**tags, **member})
        self.tally(eps, tags.get("kind"))
        return eps

    def _attempt(self, tasks, seeds, cfg, render, slots, ctx_seeds, members=None) -> list:
        """One attempt at the episodes of ``tasks``, each in a fresh environment."""
        envs = []
        try:
            for _ in tasks:  # one at a time: those built before a constructor raised are closed
                envs.append(self.make_env(self.cfg.max_turns))
        except Exception as e:  # noqa: BLE001 - an environment that cannot be built cannot be played: one line
            for env in envs:
                getattr(env, "close", lambda: None)()
            if isinstance(e, InfraError):  # the infrastructure's failure: the caller's to retry or count
                raise
            raise StartupError(f"env.name={self.cfg.name}: building its environment raised "
                               f"{type(e).__name__}: {e}") from e
        # an environment may cap the episodes played at once (one browser each, say)
        group = self._group(len(tasks))
        eps = []
        try:
            for a in range(0, len(tasks), group):
                b = a + group
                ctx = [render(s, k) for s, k in zip(ctx_seeds[a:b], slots[a:b])] if render is not None else None
                eps += run_episodes(self.engine, envs[a:b], tasks[a:b], seeds[a:b], cfg, ctx,
                                    **({} if members is None else {"members": members[a:b]}))
        finally:
            for env in envs:  # an episode the loop abandoned (its wall clock) still holds its browser
                getattr(env, "close", lambda: None)()
        return eps

    def make_env(self, max_turns: int):
        """A fresh environment of ``env.name`` built from its section (each episode gets its own)."""
        return self.spec.build(self.section, max_turns=max_turns, sandbox=self.cfg.sandbox)

    def _group(self, n: int) -> int:
        """Episodes played at once: all, or the environment's cap (``EnvSpec.max_concurrent``)."""
        cap = self.max_concurrent
        return max(1, min(n, cap) if cap else n)

    def step_tasks(self, step: int) -> list[dict]:
        """The step's training tasks (``fixed_task``: the first training task every time)."""
        if self.fixed_task:
            return [self.train_tasks[0]] * self.cfg.episodes_per_step
        return draw_step_tasks(self.train_tasks, self.run_seed, step, self.cfg.episodes_per_step)

    def score_program(self, code: str, step: int = 0) -> float | None:
        """Mean score of ``code`` over step ``step``'s tasks, evaluated as an episode's reply is (same environment,
        same sandbox); None if it fails on any. No model runs: the seed program's fitness, outside the budget."""
        scores = []
        for task in self.step_tasks(step):
            env = self.make_env(1)
            try:
                env.reset(task)
                info = env.step(f"```python\n{code.rstrip()}\n```")[4]
            finally:  # an env holding a sandbox or a browser is closed also when it raised, as play does
                getattr(env, "close", lambda: None)()
            if info.get("error") is not None or info.get("score") is None:
                return None
            scores.append(float(info["score"]))
        return sum(scores) / len(scores)


def draw_step_tasks(train_tasks: list[dict], run_seed: int, step: int, n: int) -> list[dict]:
    """Step ``step``'s ``n`` training tasks from the run's ``tasks`` stream: the same for every member (common random
    numbers) and every player (environment or harness)."""
    return [train_tasks[i] for i in step_task_indices(len(train_tasks), run_seed, step, n)]


def step_task_indices(n_tasks: int, run_seed: int, step: int, n: int) -> list[int]:
    """Which ``n`` of ``n_tasks`` training tasks step ``step`` plays: the one draw from the ``tasks`` stream, for
    ES's members and the baselines' groups alike."""
    return random.Random(stream_seed(run_seed, "tasks", step)).sample(range(n_tasks), n)


def return_total(eps, failed_count: bool = False) -> tuple[float, int]:
    """(sum, count) of the finite episode returns; ``failed_count``: an infrastructure-failed episode (NaN) scores its
    env's failure return instead of being left out (comparisons where failing must cost)."""
    rets = [e.floor if math.isnan(e.ret) else e.ret for e in eps] if failed_count else \
        [e.ret for e in eps if not math.isnan(e.ret)]
    return sum(rets), len(rets)


class AgentObjective:
    def __init__(self, player: EpisodePlayer, context=None):
        """``context``: the run's context (``esopt_mp.prompt.run.PromptRun``) or None: its text joins each system
        prompt and the training episodes become its trajectories (:meth:`take_trajectories`)."""
        self.player, self.context = player, context
        self.held_out = HeldOut(player, context)
        self.trajectories: list = []  # the prompt optimiser's trajectories of the current step (TP leaders')

    def evaluate_member(self, member) -> float:
        """Member ``member``'s mean return over its step's tasks (NaN if every episode was an infrastructure fault)."""
        return self.evaluate_members([member])[member.index]

    def evaluate_members(self, members: list, batched: bool = False) -> dict[int, float]:
        """Each member's mean return (:meth:`evaluate_member`); ``batched``: all their episodes in one batch, member
        ``members[s]`` at slot s of the engine's members (es.member_batch: the weights are not perturbed)."""
        p = self.player
        tasks, seeds, slots, ctx_seeds, which = [], [], [], [], []
        for s, member in enumerate(members):
            t, sd = p.member_episodes(member)
            # a prompt optimiser shares the step's episodes out by slot: consecutive within the step (EoH: every
            # operator equally often, +-1) and shifted by the step (an operator the step has too few slots for runs
            # at later steps); both members of a mirrored pair play the same slots and contexts (operator and
            # parents), their token sampling differs as any two members' does (unless env.common_draws)
            pair = member.pair if member.pair >= 0 else member.index
            ks = [member.step + pair * len(t) + e for e in range(len(t))]
            tasks += t
            seeds += sd
            slots += ks
            ctx_seeds += [stream_seed(p.run_seed, "context", member.step, k) for k in ks]
            which += [s] * len(t)
        ctx = {} if self.context is None else {"render": self.context.render, "context": self.context.hash}
        step = members[0].step
        if batched:
            eps = p.play(tasks, seeds, p.train_cfg, slots=slots, ctx_seeds=ctx_seeds, members=which, kind="train",
                         step=step, member=[m.index for m in members], **ctx)
        else:
            eps = p.play(tasks, seeds, p.train_cfg, slots=slots, ctx_seeds=ctx_seeds, kind="train", step=step,
                         member=members[0].index, **ctx)
        if not eps:  # a TP peer: the leader's returns reach it through the gather
            eps = [None] * len(tasks)
        out = {}
        for s, member in enumerate(members):
            mine = [(k, e) for k, e, w in zip(slots, eps, which) if w == s and e is not None]
            if self.context is not None and mine:
                self._keep_trajectories(member, mine)
            total, n = return_total([e for _, e in mine])
            out[member.index] = total / n if n else math.nan
        return out

    def _keep_trajectories(self, member, played) -> None:
        from esopt_mp.prompt import Trajectory

        extract = self.player.spec.program_extractor()  # the env's own extraction: the program it evaluated
        self.trajectories += [Trajectory.from_turns(e.ret, e.turns, member.index, extract, k, member.step)
                              for k, e in played]

    def evaluate_held_out(self) -> tuple[float, dict]:
        """(Mean@k, its details) of the unperturbed weights on every rank (:meth:`HeldOut.evaluate`)."""
        return self.held_out.evaluate()

    def take_failures(self) -> list[int]:
        """Failed training episodes this rank played since the last call, per kind of ``FAILURE_KINDS``."""
        return self.player.take_failures()

    def take_retried(self) -> list[int]:
        """[episodes played again, members evaluated again] on this rank since the last call (the player's)."""
        return self.player.take_retried()

    def take_trajectories(self) -> list:
        """This rank's training trajectories since the last call (the prompt optimiser's; TP peers hold none)."""
        out, self.trajectories = self.trajectories, []
        return out

    @property
    def recent_errors(self) -> list[str]:
        """A few errors of the last episodes this rank played (health warnings)."""
        return self.player.recent_errors
