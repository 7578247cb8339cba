"""Env protocol (Gymnasium-style, chat messages) and how a batch of environments is called.

``reset(task) -> (messages, info)``: the opening messages of an episode.
``step(assistant_text) -> (messages, reward, terminated, truncated, info)``:
messages to append (environment feedback, usually one user message), the
reward (0 until the episode ends: a terminal-reward setting), and whether the
episode ended by itself (terminated) or ran out of budget (truncated). The
episode's return is the last step's reward, or the sum of the step rewards for an
environment that says ``returns = "sum"`` (dense rewards). The
agent loop enforces the turn and token budgets on top of ``max_turns``.

Failures, and who they count against. ``step`` must not raise on anything the model writes: bad text is feedback.
An episode that fails because of what the model wrote or did -- ``step`` raised anything but
:class:`InfraError`, or the episode overran its wall clock -- scores the environment's ``failure_return`` (0
unless the environment says otherwise: a heuristic's failure score) and counts, so a perturbation that makes
episodes crash cannot score higher than one that loses them. Only :class:`InfraError` (and any failure at
``reset``, which sees no model text) marks the infrastructure: a site down, a sandbox that could not start, a
browser that died. Those episodes are left out of the member's mean (their return is NaN). Each kind is counted
(:data:`FAILURE_KINDS`) in the ledger and the step log.
An environment whose instances wait on I/O and may run side by side (one
browser each, or a sandbox process per tool call) says ``concurrent = True``: :func:`call_envs` then runs
the resets, or the steps of one turn, of a batch on a bounded number of threads.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

from esopt_mp.core.errors import FAILURE_KINDS, InfraError, StartupError  # noqa: F401 - the plugin API's names

Message = dict[str, Any]


def failure_return(env) -> float:
    """What an episode of ``env`` that failed by the model's doing scores: ``env.failure_return``, else 0."""
    value = float(getattr(env, "failure_return", 0.0))
    if value != value:
        raise ValueError(f"{type(env).__name__}.failure_return is NaN: it must be a return the model can beat")
    return value


def returns_sum(env) -> bool:
    """Whether ``env``'s return is the sum of its step rewards (``returns = "sum"``: dense rewards) rather than
    the last step's reward (``"last"``, the default: a terminal reward, or the env's score of the episode)."""
    how = getattr(env, "returns", "last")
    if how not in ("last", "sum"):
        raise ValueError(f"{type(env).__name__}.returns must be 'last' or 'sum', got {how!r}")
    return how == "sum"


@runtime_checkable
class Env(Protocol):
    name: str
    max_turns: int

    def reset(self, task: dict) -> tuple[list[Message], dict]: ...

    def step(self, assistant_text: str) -> tuple[list[Message], float, bool, bool, dict]: ...


MAX_WORKERS = 64  # sandbox per-call uids are unique among 256 live calls of a process (sandbox/core.py)


def default_workers() -> int:
    """Threads for a batch's env calls when ``env.env_workers`` is 0: the cores, at least 8 (calls wait on I/O)."""
    return min(MAX_WORKERS, max(8, os.cpu_count() or 1))


def call_envs(calls: list[tuple[Env, str, Any]], max_workers: int = 0) -> list[tuple[Any, Exception | None, float]]:
    """``(result, error, seconds)`` of ``getattr(env, method)(arg)`` for each ``(env, method, arg)``, in order.

    On at most ``max_workers`` threads (0: :func:`default_workers`; a held-out batch of 400 episodes must not
    mean 400 threads) when every env says ``concurrent = True``; otherwise one after another. An ``Exception``
    is returned as the error; anything else (KeyboardInterrupt) propagates. The results are the same
    whichever call finishes first: each env's call is independent of the others'.
    """
    def one(call):
        env, method, arg = call
        t = time.perf_counter()
        try:
            return getattr(env, method)(arg), None, time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 - the caller decides (the agent loop fails the episode)
            return None, e, time.perf_counter() - t

    if len(calls) > 1 and all(getattr(env, "concurrent", False) for env, _, _ in calls):
        workers = min(len(calls), max_workers or default_workers())
        with ThreadPoolExecutor(workers, thread_name_prefix="esopt-env") as ex:
            return list(ex.map(one, calls))
    return [one(c) for c in calls]
