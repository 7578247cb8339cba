"""Non-agentic ES objectives: what a member's return is when no environment is involved.

Every objective answers the trainer the same few calls: ``evaluate_member(member)`` (a perturbed member's return),
``evaluate_held_out()`` (the unperturbed weights' held-out score and its details), ``take_failures()`` (failed
episodes by kind; None: no episodes), ``take_trajectories()`` and ``recent_errors``. Agent environments (Sudoku, ReAct
math, ...) plug in through :class:`esopt_mp.agent.episodes.AgentObjective`. These two exist for the parallel core:

- ``target_logprob``: mean log-likelihood of fixed target continuations
  (a copy task over random token prompts), one batched teacher-forced forward.
  Computed from the model's own outputs, identical on every TP rank.
- ``seed_hash``: a return that depends only on the member's seed and sign, so
  runs on different layouts must end with bit-identical weights.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from esopt_mp.core.types import Member
from esopt_mp.es.seeds import M64, splitmix64

if TYPE_CHECKING:
    import torch


class Objective(Protocol):
    """What the ES trainer asks of an objective (``esopt_mp.agent.episodes.AgentObjective`` is the agent's)."""

    def evaluate_member(self, member: Member) -> float:
        """The return of ``member`` (its perturbation applied to the weights by the trainer)."""

    def evaluate_held_out(self) -> tuple[float, dict]:
        """The held-out score of the unperturbed weights, on every rank, and its details for the metrics."""

    def take_failures(self) -> list[int] | None:
        """This rank's failed episodes by kind since the last call (``FAILURE_KINDS``); None: no episodes."""

    def take_trajectories(self) -> list:
        """This rank's trajectories for the prompt optimiser since the last call."""

    @property
    def recent_errors(self) -> list[str]:
        """A few errors of the last episodes this rank played (health warnings)."""


class _Episodeless:
    """What an objective without episodes answers: no failures, no trajectories, no episode errors."""

    @property
    def recent_errors(self) -> list[str]:
        return []

    def take_failures(self) -> None:
        return None

    def take_trajectories(self) -> list:
        return []


class SeedHash(_Episodeless):
    def __init__(self, cfg, model):
        pass

    def evaluate_member(self, member: Member) -> float:
        return splitmix64(member.seed ^ (M64 if member.sign < 0 else 0)) / 2.0**64

    def evaluate_held_out(self) -> tuple[float, dict]:
        return 0.0, {}


class TargetLogProb(_Episodeless):
    def __init__(self, cfg, model):
        import torch  # here, not at import: the config validates objective names without torch

        self.model = model
        vocab_size = model.config.vocab_size
        g = torch.Generator().manual_seed(cfg.seed)
        self.prompt_len = cfg.prompt_len
        # the target copies the first target_len prompt tokens: learnable by attention
        train = torch.randint(0, vocab_size, (cfg.batch, cfg.prompt_len), generator=g)
        held = torch.randint(0, vocab_size, (cfg.batch, cfg.prompt_len), generator=g)
        reps = -(-cfg.target_len // cfg.prompt_len)
        self.train_ids = torch.cat([train, train.repeat(1, reps)[:, : cfg.target_len]], 1)
        self.eval_ids = torch.cat([held, held.repeat(1, reps)[:, : cfg.target_len]], 1)

    def score(self, model, ids: torch.Tensor) -> float:
        import torch

        device = next(model.parameters()).device
        ids = ids.to(device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        logp = torch.log_softmax(logits[:, self.prompt_len - 1 : -1].float(), dim=-1)
        target = ids[:, self.prompt_len :]
        return float(logp.gather(-1, target[..., None]).mean())

    def evaluate_member(self, member: Member) -> float:
        """Return of a (perturbed) member on the training batch."""
        return self.score(self.model, self.train_ids)

    def evaluate_held_out(self) -> tuple[float, dict]:
        return self.score(self.model, self.eval_ids), {}


# Every objective.name, once: the class of a function of the weights, or None for the objectives that play
# episodes, which esopt_mp.build makes on an engine ("agent": esopt_mp.agent.episodes.AgentObjective; "harness",
# with an endpoint server: esopt_mp.agent.harness.HarnessObjective)
OBJECTIVES = {"target_logprob": TargetLogProb, "seed_hash": SeedHash, "agent": None, "harness": None}
EPISODIC = tuple(name for name, cls in OBJECTIVES.items() if cls is None)  # ObjectiveConfig.episodic
# How the episodic kinds play (ObjectiveConfig.in_process / .served): the in-process loop, whose episodes carry token
# log-probs and trajectories (the baselines, prompt optimisers and members in one batch need it), or the user's
# program against the served member (an endpoint and its connections)
IN_PROCESS = ("agent",)
SERVED = ("harness",)
