"""Environments: the Env protocol, the registry (``make``) and the built-in tasks."""
from esopt_mp.envs.base import FAILURE_KINDS, Env, InfraError, failure_return, make, register, registered

__all__ = ["FAILURE_KINDS", "Env", "InfraError", "failure_return", "make", "register", "registered"]
