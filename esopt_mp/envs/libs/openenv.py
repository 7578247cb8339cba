"""An OpenEnv environment served by its own server, played over OpenEnv's WebSocket client.

``env.openenv.url`` is the server's base address (``http://host:port`` or ``ws://host:port``; the client speaks
to its ``/ws`` route). Each episode is one WebSocket session, so one environment instance on the server: reset
with the task's seed (and ``reset_kwargs``), then one step per model reply, until the observation says ``done``
or the turn budget ends; the session is closed when the episode ends. A task is a reset seed; the training and
held-out seeds never meet (even and odd).

How a reply becomes the environment's Action (a pydantic model on the server, validated there):

- ``action_format=text``: the reply (or, with ``action_pattern``, the text of its last match: the first group
  when the pattern has one) is the value of the Action's field ``action_field``; the server's model coerces it
  (``"42"`` becomes 42 for an ``int`` field).
- ``action_format=json``: the reply carries one JSON object (the last one written), sent as the whole Action;
  the system message then lists the Action's fields from the server's ``/schema``.

The observation shown to the model is its field ``obs_field``, else its only field, else all of its fields as
JSON. The step's reward is the Observation's ``reward`` (none counts 0); the return is their sum
(``returns=sum``, OpenEnv's rewards are per step) or the last one (``returns=last``).

Who a failure counts against. An action the server's Action model refuses (a validation error), a reply with no
JSON object or no match of the pattern: feedback to the model with the server's reasons, the turn spent
(``invalid_action=fail``: the model's failure instead). An action the environment fails on (its ``step`` raised)
or that it does not answer within ``step_timeout_s`` while the server still answers its health check: the
model's failure (it scores ``failure_return``). The server unreachable, at capacity beyond ``capacity_wait_s``,
unable to build its environment, the connection lost, a reply that breaks the protocol, or a failure at reset:
:class:`~esopt_mp.envs.base.InfraError` (the episode is left out of the member's mean).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from typing import Any

from esopt_mp.envs.base import InfraError
from esopt_mp.envs.libs.openenv_client import (ServerError, action_schema, client_class, find_json_object, healthy,
                                               http_base, refusal)
from esopt_mp.chat.format import clean_text
from esopt_mp.chat.toolcalls import MAX_DEPTH, clean_value, depth
from esopt_mp.envs.libs.seeds import split_seeds

FORMATS = ("text", "json")
RETURNS = ("sum", "last")
INVALID = ("feedback", "fail")


@dataclasses.dataclass
class OpenEnvConfig:
    """The ``env.openenv`` section."""

    url: str = ""  # the server's base address: http(s)://host:port or ws(s)://host:port
    action_format: str = "text"  # text: the reply fills action_field; json: the reply's JSON object is the Action
    action_field: str = "message"  # text format: the Action field that receives the reply
    action_pattern: str = ""  # text format: a regex; its last match in the reply (group 1 if any) is sent
    obs_field: str = ""  # the Observation field shown ('' : its only field, else all fields as JSON)
    reset_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # more reset() arguments of the env
    returns: str = "sum"  # sum: the step rewards added up (OpenEnv's rewards are per step); last: the final one
    invalid_action: str = "feedback"  # a refused action: feedback (the turn is spent) or fail (the model's failure)
    failure_return: float = 0.0  # what an episode the model failed scores: at or below the env's lowest return
    system_prompt: str | None = None  # the opening system message (None: one describing the action; '': none)
    max_concurrent: int = 1  # episodes at once per rank: at most the server's max_concurrent_envs (its default 1)
    connect_timeout_s: float = 10.0  # opening the WebSocket
    step_timeout_s: float = 60.0  # one reset or step answered
    capacity_wait_s: float = 30.0  # how long a reset waits for a free session while the server is at capacity
    max_obs_chars: int = 8000  # an observation longer than this is cut (the rest is not shown)

    def validate(self, key: str = "env.openenv") -> None:
        def check(cond: bool, k: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{key}.{k}: {msg}")

        check(bool(self.url), "url", "the OpenEnv server's address is required (e.g. http://127.0.0.1:8000)")
        check(re.match(r"^(https?|wss?)://[^/\s]+", self.url) is not None, "url",
              f"must be http(s)://host:port or ws(s)://host:port, got {self.url!r}")
        check(self.action_format in FORMATS, "action_format", f"must be one of {FORMATS}, got {self.action_format!r}")
        check(self.action_format == "json" or bool(self.action_field), "action_field",
              "the Action field receiving the reply is required with action_format=text")
        if self.action_pattern:
            try:
                re.compile(self.action_pattern)
            except re.error as e:
                raise ValueError(f"{key}.action_pattern: not a regular expression: {e}") from None
        check(isinstance(self.reset_kwargs, dict), "reset_kwargs", f"expected a mapping, got {self.reset_kwargs!r}")
        check("seed" not in self.reset_kwargs, "reset_kwargs", "seed comes from the task, not the section")
        check(self.returns in RETURNS, "returns", f"must be one of {RETURNS}, got {self.returns!r}")
        check(self.invalid_action in INVALID, "invalid_action",
              f"must be one of {INVALID}, got {self.invalid_action!r}")
        check(math.isfinite(self.failure_return), "failure_return", f"must be finite, got {self.failure_return}")
        check(self.max_concurrent >= 1, "max_concurrent", f"must be >= 1, got {self.max_concurrent}")
        for k in ("connect_timeout_s", "step_timeout_s"):
            v = getattr(self, k)
            check(math.isfinite(v) and v > 0, k, f"must be a finite number of seconds > 0, got {v}")
        check(math.isfinite(self.capacity_wait_s) and self.capacity_wait_s >= 0, "capacity_wait_s",
              f"must be a finite number of seconds >= 0, got {self.capacity_wait_s}")
        check(self.max_obs_chars >= 64, "max_obs_chars", f"must be >= 64, got {self.max_obs_chars}")


class OpenEnvEnv:
    """One episode: one WebSocket session with an OpenEnv server (see the module docstring)."""

    name = "openenv"
    config = OpenEnvConfig
    requires = {"openenv": "openenv-core>=0.3.0"}
    extra = "openenv"
    runs_code = False
    max_concurrent = 1  # the section's max_concurrent (OpenEnv servers hold one session unless told more)
    concurrent = True  # each episode waits on its own session: a batch's resets and steps may run on threads
    returns = "sum"
    failure_return = 0.0

    def __init__(self, *, max_turns: int = 8, url: str = "", action_format: str = "text",
                 action_field: str = "message", action_pattern: str = "", obs_field: str = "",
                 reset_kwargs: dict[str, Any] | None = None, returns: str = "sum", invalid_action: str = "feedback",
                 failure_return: float = 0.0, system_prompt: str | None = None, max_concurrent: int = 1,
                 connect_timeout_s: float = 10.0, step_timeout_s: float = 60.0, capacity_wait_s: float = 30.0,
                 max_obs_chars: int = 8000):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.cfg = OpenEnvConfig(url=url, action_format=action_format, action_field=action_field,
                                 action_pattern=action_pattern, obs_field=obs_field,
                                 reset_kwargs=dict(reset_kwargs or {}), returns=returns,
                                 invalid_action=invalid_action, failure_return=failure_return,
                                 system_prompt=system_prompt, max_concurrent=max_concurrent,
                                 connect_timeout_s=connect_timeout_s, step_timeout_s=step_timeout_s,
                                 capacity_wait_s=capacity_wait_s, max_obs_chars=max_obs_chars)
        self.cfg.validate()
        self.max_turns = max_turns
        self.returns = returns
        self.failure_return = float(failure_return)
        self._pattern = re.compile(action_pattern) if action_pattern else None
        self._client = None
        self.turn = 0

    # -- the task source and the start-up check --------------------------------------------------
    @classmethod
    def tasks(cls, split: str, n: int, seed: int, **_) -> list[dict]:
        """``n`` reset seeds of ``split``, drawn from ``seed``: even for "train", odd for "eval" (never the same)."""
        return [{"id": f"openenv-s{s}", "seed": s} for s in split_seeds(split, n, seed)]

    @classmethod
    def check(cls, url: str = "", connect_timeout_s: float = 10.0, step_timeout_s: float = 60.0, **_) -> None:
        """On each playing rank: the server answers a WebSocket session (opened, asked its state, closed)."""
        client = client_class()(base_url=http_base(url), connect_timeout_s=connect_timeout_s,
                                 message_timeout_s=step_timeout_s).sync()
        try:
            client.connect()
            client.state()
        except ServerError as e:
            if e.code == "FACTORY_ERROR":
                raise RuntimeError(f"env.openenv.url={url}: the OpenEnv server cannot build its environment "
                                   f"({e})") from None
            # it answered (at capacity now, or its state needs a reset first): it is up
        except Exception as e:  # noqa: BLE001 - whatever stops the session is named in one line
            why = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise RuntimeError(f"env.openenv.url={url}: the OpenEnv server does not answer: {why}") from None
        finally:
            _close_quietly(client)

    # -- the Env protocol ----------------------------------------------------------------------
    def reset(self, task: dict):
        seed = task.get("seed")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"task {task.get('id')!r}: seed must be an integer >= 0, got {seed!r}")
        self.close()
        self.turn = 0
        try:
            obs = self._open(seed)
            system = self._system()
            first = self._render(obs)
        except BaseException:
            self.close()
            raise
        opening = [{"role": "system", "content": system}] if system else []
        return opening + [{"role": "user", "content": first}], {"id": task.get("id"), "seed": seed}

    def _open(self, seed: int) -> dict:
        """A new session reset with ``seed`` (waiting up to ``capacity_wait_s`` for a free one): its observation."""
        cfg = self.cfg
        deadline, pause = time.monotonic() + cfg.capacity_wait_s, 0.1
        while True:
            self._client = client_class()(base_url=http_base(cfg.url), connect_timeout_s=cfg.connect_timeout_s,
                                           message_timeout_s=cfg.step_timeout_s).sync()
            try:
                result = self._client.reset(**{**cfg.reset_kwargs, "seed": seed})
                break
            except ServerError as e:
                self.close()
                if e.code != "CAPACITY_REACHED":
                    raise InfraError(f"the OpenEnv server at {cfg.url} failed the reset: {e}") from None
                if time.monotonic() + pause > deadline:
                    raise InfraError(f"the OpenEnv server at {cfg.url} stayed at capacity for "
                                     f"env.openenv.capacity_wait_s={cfg.capacity_wait_s:g} s: {e}") from None
                time.sleep(pause)
                pause = min(1.0, pause * 2)
            except Exception as e:  # noqa: BLE001 - unreachable, connection lost, a reply breaking the protocol
                raise InfraError(f"the OpenEnv server at {cfg.url} did not reset: {type(e).__name__}: {e}") from None
        obs, _, done = self._result(result)
        if done:
            raise InfraError(f"the OpenEnv server at {cfg.url} ended the episode at its reset (seed {seed})")
        return obs

    def step(self, text: str):
        if self._client is None:
            raise RuntimeError("step() outside an episode (before reset, or after it ended)")
        self.turn += 1
        out_of_turns = self.turn >= self.max_turns
        try:
            action, why = self._action(clean_text(text if isinstance(text, str) else str(text)))
            result = self._send(action) if action is not None else None
            if isinstance(result, str):
                action, why = None, result
            if action is None:  # refused: the server's reasons (or ours) go back to the model
                if self.cfg.invalid_action == "fail":
                    raise ValueError(f"invalid action: {why}")
                info = {"turn": self.turn, "valid_action": False, "error": why[:500]}
                if out_of_turns:  # the reasons, but no call for another action: the turn after the last does not exist
                    self.close()
                    end = f"Out of turns ({self.turn}/{self.max_turns}): the episode is over."
                    return [{"role": "user", "content": f"{why}\n{end}"}], 0.0, False, True, info
                return [{"role": "user", "content": f"{why}\n{self._usage()}"}], 0.0, False, False, info
            obs, reward, done = self._result(result)
            info = {"turn": self.turn, "valid_action": True}
            if done or out_of_turns:
                self.close()
                return [], reward, done, not done, info
            return [{"role": "user", "content": self._render(obs)}], reward, False, False, info
        except BaseException:
            self.close()
            raise

    def _send(self, action: dict):
        """The StepResult of ``action``, or the server's reasons (a str) when its Action model refuses it."""
        try:
            return self._client.step(action)
        except ServerError as e:
            if e.code == "VALIDATION_ERROR":
                return f"the environment refused the action: {refusal(e.data)}"
            if e.code in ("EXECUTION_ERROR", "SESSION_ERROR"):  # the env (or its reply) failed on this action
                raise RuntimeError(f"the environment failed the action: {e}") from None
            raise InfraError(f"the OpenEnv server at {self.cfg.url} broke the protocol: {e}") from None
        except TimeoutError:
            if not healthy(self.cfg.url, self.cfg.connect_timeout_s):
                raise InfraError(f"the OpenEnv server at {self.cfg.url} stopped answering") from None
            raise TimeoutError(f"the environment did not answer the action within env.openenv.step_timeout_s="
                               f"{self.cfg.step_timeout_s:g} s; the server answers, so the action is the "
                               "model's") from None
        except Exception as e:  # noqa: BLE001 - the connection lost, a reply breaking the protocol
            raise InfraError(f"the OpenEnv session at {self.cfg.url} failed: {type(e).__name__}: {e}") from None

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            _close_quietly(client)

    def __del__(self):
        self.close()

    # -- helpers -------------------------------------------------------------------------------
    def _action(self, text: str) -> tuple[dict | None, str]:
        """(the Action's JSON, '') from a reply, or (None, why it has none)."""
        if self.cfg.action_format == "json":
            value = find_json_object(text)
            if value is None:
                return None, "no JSON object found in the reply"
            if depth(value) > MAX_DEPTH:
                return None, f"the JSON object nests deeper than {MAX_DEPTH} levels"
            return clean_value(value), ""
        if self._pattern is None:
            return {self.cfg.action_field: text.strip()}, ""
        matches = list(self._pattern.finditer(text))
        if not matches:
            return None, f"no action matching {self.cfg.action_pattern!r} found in the reply"
        last = matches[-1]
        value = last.group(1) if self._pattern.groups else last.group(0)
        return {self.cfg.action_field: (value or "").strip()}, ""

    def _usage(self) -> str:
        if self.cfg.action_format == "json":
            try:
                fields = action_schema(self.cfg.url, self.cfg.connect_timeout_s)
            except (OSError, ValueError, AttributeError) as e:
                raise InfraError(f"the OpenEnv server at {self.cfg.url} did not give its action schema: "
                                 f"{type(e).__name__}: {e}") from None
            return f"Reply with one JSON object, the action, with the fields {fields}."
        if self._pattern is not None:
            return f"End your reply with the action, written to match the pattern {self.cfg.action_pattern!r}."
        return f"Your whole reply is the action's `{self.cfg.action_field}`."

    def _system(self) -> str:
        if self.cfg.system_prompt is not None:
            return self.cfg.system_prompt
        return "You are acting in an environment. Each turn you see its observation; reply with one action. " + \
            self._usage()

    def _result(self, result) -> tuple[dict, float, bool]:
        """(observation, reward, done) of a StepResult; a malformed one is the server's fault."""
        obs, reward, done = result.observation, result.reward, result.done
        if not isinstance(obs, dict) or not isinstance(done, bool):
            raise InfraError(f"the OpenEnv server at {self.cfg.url} sent a malformed observation: {result!r:.300}")
        if reward is None:
            reward = 0.0
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise InfraError(f"the OpenEnv server at {self.cfg.url} sent a reward that is not a finite number: "
                             f"{reward!r:.100}")
        return obs, float(reward), done

    def _render(self, obs: dict) -> str:
        field = self.cfg.obs_field
        if field:
            if field not in obs:
                raise InfraError(f"env.openenv.obs_field={field!r}: the observation has fields {sorted(obs)}")
            value = obs[field]
        elif len(obs) == 1:
            (value,) = obs.values()
        else:
            value = obs
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        limit = self.cfg.max_obs_chars
        return clean_text(text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} characters cut]")


def _close_quietly(client) -> None:
    """Close a sync client and stop its loop thread; a dead connection is already closed."""
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing must not hide the episode's own outcome
        try:
            client._stop_loop()
        except Exception:  # noqa: BLE001
            pass
