"""A verifiers (v1) environment as the harness: each episode is one rollout of verifiers' own code against the member.

``objective.callable=esopt_mp.agent.harnesses.verifiers_v1:play`` with ``ESOPT_VERIFIERS_ENV`` naming the environment
(a taskset id, the env block as JSON, or a ``.json`` / ``.toml`` file holding it). Each episode builds the
environment (``verifiers.v1.load_environment``), picks the task the episode's task names (``{"idx": 3}``: the
taskset's 4th task; ``{"id": "..."}``: the task with that id) and plays it with ``Env.run_slot``: the taskset's
harness program in its runtime, verifiers' interception server relaying every model call (streamed, with its
``X-Session-ID``) to the episode's base URL and the member's name, the task's ``@vf.reward`` functions. The
episode's return is the rollout's reward (the mean over the trainable seats of a multi-seat environment).

A rollout verifiers records as failed raises: at the provider / interception / sandbox boundary (the endpoint
refused or could not be reached, the runtime broke) as :class:`esopt_mp.envs.InfraError`, the episode left out; any
other failure (the harness program exited non-zero, the task's scoring raised, a deadline of the environment) with
verifiers' error line, the episode scoring ``objective.failure_return``.

Seats whose runtime is not set run in the subprocess runtime (verifiers' own default is a remote sandbox). Your own
environment plugs in as verifiers loads any: an importable package exporting its ``Taskset`` (and, optionally, its
``Harness`` / ``Env``) in ``__all__``; or build a callable for it in your module::

    from esopt_mp.agent.harnesses.verifiers_v1 import player
    play = player({"taskset": {"id": "my_taskset", "size": 100}, "agent": {"max_turns": 4}})
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import threading
from collections.abc import Callable
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.configs.agent import agent_config_fields

from esopt_mp.core.errors import InfraError

ENV_VAR = "ESOPT_VERIFIERS_ENV"
_INFRA = ("ProviderError", "InterceptionError", "TunnelError", "SandboxError", "ToolsetError")
_LOOP: list = []  # the one event loop every rollout of this process runs on (a daemon thread)
_LOCK = threading.Lock()


def env_block(spec: str | dict) -> dict:
    """The verifiers env block a setting names: a taskset id, a JSON object, or a ``.json`` / ``.toml`` file."""
    if isinstance(spec, dict):
        return dict(spec)
    spec = spec.strip()
    if not spec:
        raise ValueError(f"{ENV_VAR} is not set: name a verifiers taskset id, or the env block as JSON or a "
                         ".json/.toml file")
    if spec.startswith("{"):
        return json.loads(spec)
    if spec.endswith((".json", ".toml")):
        with open(spec, "rb") as f:
            if spec.endswith(".json"):
                return json.load(f)
            import tomllib
            block = tomllib.load(f)
        return block.get("env", block)
    return {"taskset": {"id": spec}}


def env_config(block: dict):
    """The environment's ``EnvConfig`` (the env's own subclass), every seat without a runtime in the subprocess one."""
    taskset = block.get("taskset") or {}
    cls = vf.env_config_type(taskset.get("id", ""), block.get("id", ""))
    cfg = cls.model_validate(block)
    local = {}
    for name, seat in agent_config_fields(cfg).items():
        if "runtime" not in seat.model_fields_set:
            local[name] = seat.model_copy(update={"runtime": vf.SubprocessConfig()})
    return cfg.model_copy(update=local) if local else cfg


class _Tasks:
    """A taskset's tasks read once, as far as the episodes ask (a taskset may be infinite), shared by the threads."""

    def __init__(self, taskset):
        self._iter, self._seen, self._lock = iter(taskset), [], threading.Lock()

    def _more(self) -> bool:
        try:
            self._seen.append(next(self._iter))
        except StopIteration:
            return False
        return True

    def pick(self, task: dict):
        with self._lock:
            if isinstance(task.get("idx"), int) and task["idx"] >= 0:
                while len(self._seen) <= task["idx"]:
                    if not self._more():
                        raise ValueError(f"the taskset has {len(self._seen)} tasks: no idx {task['idx']}")
                return self._seen[task["idx"]]
            if "id" in task:
                want = str(task["id"])
                for t in self._seen:
                    if t.data.id == want:
                        return t
                while self._more():
                    if self._seen[-1].data.id == want:
                        return self._seen[-1]
                raise ValueError(f"no task of the taskset has id {want!r}")
        raise ValueError(f"a task names its verifiers task by 'idx' (its position) or 'id': got {sorted(task)}")


def _loop() -> asyncio.AbstractEventLoop:
    with _LOCK:
        if not _LOOP:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="verifiers-rollouts", daemon=True).start()
            _LOOP.append(loop)
        return _LOOP[0]


def reward(episode) -> float:
    """The return of a finished rollout; its failure raised (see the module's docstring)."""
    if not episode.ok:
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        err = errors[-1] if errors else None
        line = f"{err.type}: {err.message}" if err else "the rollout did not complete"
        if err is not None and err.type in _INFRA:
            raise InfraError(f"verifiers rollout: {line}")
        raise RuntimeError(f"verifiers rollout: {line}")
    traces = [t for t in episode.traces if t.agent.trainable] or episode.traces
    value = sum(t.reward for t in traces) / len(traces)
    if not math.isfinite(value):
        raise RuntimeError(f"verifiers rollout: its reward {value} is not finite")
    return float(value)


def player(env: str | dict, *, api_key_var: str = "OPENAI_API_KEY") -> Callable[[str, str, dict], float]:
    """``fn(base_url, model, task) -> float`` playing the verifiers environment ``env`` (see :func:`env_block`);
    the endpoint's key, if it has one, read from the variable ``api_key_var``."""
    cfg = env_config(env_block(env))
    tasks = _Tasks(vf.load_environment(cfg).taskset)

    async def rollout(task, ctx):
        built = vf.load_environment(cfg)
        async with built.serving():
            return await built.run_slot(built.slots(task, 1)[0], ctx)

    def play(base_url: str, model: str, task: dict) -> float:
        ctx = vf.ModelContext(model=model, client=vf.EvalClientConfig(base_url=base_url, api_key_var=api_key_var))
        job = asyncio.run_coroutine_threadsafe(rollout(tasks.pick(task), ctx), _loop())
        return reward(job.result())

    return play


_PLAYERS: dict[str, Callable] = {}


def play(base_url: str, model: str, task: dict[str, Any]) -> float:
    """One episode of the environment ``ESOPT_VERIFIERS_ENV`` names, its return the rollout's reward."""
    spec = os.environ.get(ENV_VAR, "")
    with _LOCK:
        if spec not in _PLAYERS:
            _PLAYERS[spec] = player(spec)
        fn = _PLAYERS[spec]
    return fn(base_url, model, task)
