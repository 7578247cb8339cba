"""ES objective over agent episodes: a member's return is its mean episode return.

Every member of a step plays the same tasks (common random numbers, drawn from the run's ``tasks`` stream); token
sampling uses the ``episode`` stream (``common_episode`` with ``env.common_draws``: every member alike). The TP
leader of each dp group plays the episodes; its peers join the forward passes. An episode the model failed (an environment error its text caused, its wall clock) scores the environment's
failure return; only an infrastructure fault is NaN and left out of the member's mean. Each kind is counted
(:meth:`AgentObjective.take_failures`); held-out evaluation is :class:`esopt_mp.agent.held_out.HeldOut`'s.
"""
from __future__ import annotations

import math

from esopt_mp.agent.episodes import EpisodePlayer, return_total
from esopt_mp.agent.held_out import HeldOut
from esopt_mp.es.seeds import stream_seed


class AgentObjective:
    def __init__(self, player: EpisodePlayer, context=None):
        """``context``: the run's context (``esopt_mp.prompt.run.ContextRun``) or None: its text joins each system
        prompt and the training episodes become its trajectories (:meth:`take_trajectories`)."""
        self.player, self.context = player, context
        self.held_out = HeldOut(player, context)
        self.trajectories: list = []  # the context optimiser's trajectories of the current step (TP leaders')

    def evaluate_member(self, member) -> float:
        """Member ``member``'s mean return over its step's tasks (NaN if every episode was an infrastructure fault)."""
        p = self.player
        tasks, seeds = p.member_episodes(member)
        # a context optimiser shares the step's episodes out by slot: consecutive within the step (EoH: every
        # operator equally often, +-1) and shifted by the step (an operator the step has too few slots for runs at
        # later steps); both members of a mirrored pair play the same slots and contexts (operator and parents),
        # their token sampling differs as any two members' does (unless env.common_draws)
        slots = [member.step + member.pair * len(tasks) + e for e in range(len(tasks))]
        ctx_seeds = [stream_seed(p.run_seed, "context", member.step, k) for k in slots]
        ctx = {} if self.context is None else {"render": self.context.render, "context": self.context.hash}
        eps = p.play(tasks, seeds, p.train_cfg, slots=slots, ctx_seeds=ctx_seeds, kind="train", step=member.step,
                     member=member.index, **ctx)
        if self.context is not None:
            from esopt_mp.prompt import Trajectory

            extract = p.spec.program_extractor()  # the env's own extraction: the program it evaluated
            self.trajectories += [Trajectory.from_turns(e.ret, e.turns, member.index, extract, k, member.step)
                                  for k, e in zip(slots, eps)]
        total, n = return_total(eps)
        return total / n if n else math.nan

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
        """This rank's training trajectories since the last call (the context optimiser's; TP peers hold none)."""
        out, self.trajectories = self.trajectories, []
        return out

    @property
    def recent_errors(self) -> list[str]:
        """A few errors of the last episodes this rank played (health warnings)."""
        return self.player.recent_errors
