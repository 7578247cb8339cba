"""Env protocol (Gymnasium-style, chat messages) and the registry.

``reset(task) -> (messages, info)``: the opening messages of an episode.
``step(assistant_text) -> (messages, reward, terminated, truncated, info)``:
messages to append (environment feedback, usually one user message), the
reward (0 until the episode ends: a terminal-reward setting), and whether the
episode ended by itself (terminated) or ran out of budget (truncated). The
agent loop enforces the turn and token budgets on top of ``max_turns``.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]


@runtime_checkable
class Env(Protocol):
    name: str
    max_turns: int

    def reset(self, task: dict) -> tuple[list[Message], dict]: ...

    def step(self, assistant_text: str) -> tuple[list[Message], float, bool, bool, dict]: ...


_REGISTRY: dict[str, Callable[..., Env]] = {}


def register(name: str):
    def deco(factory):
        if name in _REGISTRY:
            raise ValueError(f"environment {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return deco


def make(name: str, sandbox=None, **kwargs) -> Env:
    """A new environment instance by registered name.

    ``sandbox`` (a ``SandboxConfig`` -- the ``env.sandbox`` section -- or a ready ``Sandbox``) reaches the
    environments that run code; environments that run none (sudoku) do not take it.
    """
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; registered: {sorted(_REGISTRY)}")
    factory = _REGISTRY[name]
    if sandbox is not None and "sandbox" in inspect.signature(factory).parameters:
        kwargs["sandbox"] = sandbox
    return factory(**kwargs)


def registered() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def _load_builtin() -> None:
    import esopt_mp.envs.docvqa  # noqa: F401
    import esopt_mp.envs.heuristic  # noqa: F401
    import esopt_mp.envs.math_react  # noqa: F401
    import esopt_mp.envs.sudoku  # noqa: F401
    import esopt_mp.envs.web.env  # noqa: F401 - browsergym is imported at reset, not here
