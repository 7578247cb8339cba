"""Environments: the Env protocol, ``make`` and ``registered`` (the registry: :mod:`esopt_mp.envs.registry`).

``make`` and ``registered`` live here, above both the protocol (:mod:`esopt_mp.envs.base`) and the registry, which
imports the sandbox, whose errors derive from the protocol's.
"""
from esopt_mp.envs.base import FAILURE_KINDS, Env, InfraError, StartupError, failure_return
from esopt_mp.envs.registry import load_spec, names


def make(name: str, sandbox=None, **kwargs) -> Env:
    """A new environment instance by name, from its factory's own keyword arguments (tools and tests; the
    runtime builds episodes from the ``env.<name>`` section through :mod:`esopt_mp.envs.registry`).

    ``sandbox`` (a ``SandboxConfig`` -- the ``env.sandbox`` section -- or a ready ``Sandbox``) reaches the
    environments that run code; environments that run none (sudoku) do not take it.
    """
    return load_spec(name).make(sandbox=sandbox, **kwargs)


def registered() -> list[str]:
    """Every environment name: the built-ins and the installed plugins (nothing is imported)."""
    builtin, plugins = names()
    return sorted(builtin + plugins)


__all__ = ["FAILURE_KINDS", "Env", "InfraError", "StartupError", "failure_return", "make", "registered"]
