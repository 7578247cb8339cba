"""Environments: the Env protocol, ``make`` and ``registered`` (the registry: :mod:`esopt_mp.envs.registry`)."""
from esopt_mp.envs.base import FAILURE_KINDS, Env, InfraError, StartupError, failure_return, make, registered

__all__ = ["FAILURE_KINDS", "Env", "InfraError", "StartupError", "failure_return", "make", "registered"]
