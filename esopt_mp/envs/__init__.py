"""Environments: the Env protocol, the registry (``make``) and the built-in tasks."""
from esopt_mp.envs.base import Env, make, register, registered

__all__ = ["Env", "make", "register", "registered"]
