"""Who a failure counts against (see ``esopt_mp.envs.base`` for the episode protocol that raises them).

An episode that fails by the model's doing (bad text it wrote, a wall clock it overran) scores the environment's
failure return and counts; one the infrastructure failed (:class:`InfraError`) is left out of its member's mean.
Each kind is counted in the ledger and the step log under the names of :data:`FAILURE_KINDS`.
"""
from __future__ import annotations

FAILURE_KINDS = ("model", "wall_clock", "infra")  # the model's error, its wall clock, the infrastructure's fault


class InfraError(RuntimeError):
    """The infrastructure failed the episode (not the model): its return is left out of the member's mean."""


class StartupError(RuntimeError):
    """An environment's start-up check failed (its sandbox, browser stack, server...): nothing was played."""
