"""GEM's offline text environments: its games (``game:*``) and its reasoning-gym tasks (``rg:*``).

``env.name=gem env.gem.id=game:Sudoku-v0-easy`` plays one of GEM's registered ids (gem-llm). The model acts as
GEM asks, inside ``\\boxed{...}`` (``\\boxed{A C}``, ``\\boxed{reveal 3 2}``, ``\\boxed{42}``); GEM reads the reply
itself. Each step's reward is GEM's (a format error, a hint, a success...), and the episode's return is their sum.
The conversation is the one GEM's own chat wrapper builds: its observation as the user message, the task suffix
(the board, "Enter your next guess") appended.

A task is a seed: ``reset(seed)`` of a game; for ``rg:*`` the reasoning-gym item that seed generates (GEM's
``ReasoningGymEnv`` built with ``size=1, seed=<task seed>``, so training and held-out questions come from
different generator seeds: even for "train", odd for "eval"). The ``math:``, ``code:``, ``qa:``, ``logic:`` and
``eval:`` ids load their data from a dataset hub and are refused; games that download NLTK word lists when they
start (Wordle, Hangman, WordSearch) fail the start-up check unless that data is installed.

GEM seeds the process-global ``random`` and ``np.random`` at each reset and draws from them in steps (2048
spawns tiles): every call into it runs on the episode's own saved generator states under one process-wide lock
(:mod:`esopt_mp.envs.libs.global_rng`), the caller's restored after, so an episode plays the same whatever runs
beside it and no one else's draws move.
(The trainer itself draws from no global generator: its streams are private ``random.Random`` instances.)
"""
from __future__ import annotations

import dataclasses
import logging
import random
import re
import sys
from typing import Any

from esopt_mp.envs.libs.global_rng import GlobalRandom, owning
from esopt_mp.chat.format import clean_text
from esopt_mp.envs.libs.seeds import split_seeds

SYSTEM = ("You are playing a text game or answering a question. Follow its instructions, and put your move or "
          "answer inside \\boxed{...} as they ask.")
OFFLINE = ("game", "rg")  # id prefixes whose data ships with the package
HUB = ("math", "code", "qa", "logic", "eval")  # id prefixes that load a dataset from a hub
_OWN_RG = ("size", "seed")  # ReasoningGymEnv arguments the task source sets
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # terminal colours in library messages


def _gem():
    """The ``gem`` package, imported without its import-time ``logging.basicConfig`` (INFO to stderr) when the
    host had not configured logging: the root logger stays the host's."""
    if "gem" in sys.modules:
        return sys.modules["gem"]
    try:
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        import gem
    except ImportError:
        raise ValueError("the gem environment needs gem-llm: pip install 'esopt_mp[gem]'") from None
    for h in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(h)
    root.setLevel(level)
    return gem


def _registry() -> dict:
    _gem()
    from gem.envs.registration import ENV_REGISTRY

    return ENV_REGISTRY


def _prefix(env_id: str) -> str:
    return env_id.split(":", 1)[0] if ":" in env_id else ""


@dataclasses.dataclass
class GemConfig:
    """The ``env.gem`` section."""

    id: str = "game:GuessTheNumber-v0-easy"  # a GEM id, game:* or rg:*
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # the environment class's own arguments over
    # the id's (GuessTheNumber: min_number, max_number, max_turns -- the game's own turn limit); rg:* takes none
    system_prompt: str = SYSTEM  # the opening system message ('' sends none)

    def validate(self, key: str = "env.gem") -> None:
        env_id = self.id
        if not isinstance(env_id, str) or not env_id:
            raise ValueError(f"{key}.id: expected a GEM id such as game:Sudoku-v0-easy, got {env_id!r}")
        prefix = _prefix(env_id)
        if prefix in HUB:
            raise ValueError(f"{key}.id: {env_id} loads its data from a dataset hub, which is not reached here; "
                             "GEM's offline ids are game:* and rg:*")
        if prefix not in OFFLINE:
            raise ValueError(f"{key}.id: {env_id!r} is not a game:* or rg:* id (e.g. game:Sudoku-v0-easy, "
                             "game:TowerofHanoi-v0-easy, rg:leg_counting)")
        if not isinstance(self.kwargs, dict) or not all(isinstance(k, str) for k in self.kwargs):
            raise ValueError(f"{key}.kwargs: expected a mapping of argument names to values, got {self.kwargs!r}")
        if prefix == "rg" and self.kwargs:
            raise ValueError(f"{key}.kwargs.{next(iter(self.kwargs))}: GEM's rg:* environments take no settings here "
                             "(the task seed sets size and seed); the reasoning_gym environment takes a dataset's")
        if not isinstance(self.system_prompt, str):
            raise ValueError(f"{key}.system_prompt: expected a string, got {self.system_prompt!r}")
        if "gem" in sys.modules or _installed():
            registry = _registry()
            if env_id not in registry:
                stem = env_id.split("-")[0].lower()
                near = sorted(k for k in registry if k.split("-")[0].lower() == stem)
                raise ValueError(f"{key}.id: {env_id!r} is not a GEM id; " + (
                    f"variants of it: {', '.join(near)}" if near else
                    f"{sum(_prefix(k) in OFFLINE for k in registry)} offline ids are registered, e.g. "
                    "game:GuessTheNumber-v0-easy, game:Sudoku-v0-easy, game:Minesweeper-v0-easy, rg:leg_counting"))
            known = _arguments(registry[env_id].entry_point)
            bad = [k for k in self.kwargs if known is not None and k not in known]
            if bad:
                raise ValueError(f"{key}.kwargs.{bad[0]}: {env_id} takes {', '.join(sorted(known)) or 'no arguments'}")


def _arguments(entry_point) -> set[str] | None:
    """The named arguments of an id's environment class (GEM's classes also swallow others, silently)."""
    import importlib
    import inspect

    try:
        if isinstance(entry_point, str):
            module, _, name = entry_point.partition(":")
            entry_point = getattr(importlib.import_module(module), name)
        params = inspect.signature(entry_point.__init__).parameters.values()
    except Exception:  # noqa: BLE001 - a class that does not import is named by the start-up check
        return None
    return {p.name for p in params if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("gem") is not None


def _make(env_id: str, kwargs: dict, seed: int):
    """GEM's environment for one task (rg:*: the item of generator seed ``seed``)."""
    extra = {"size": 1, "seed": seed} if _prefix(env_id) == "rg" else {}
    return _gem().make(env_id, **kwargs, **extra)


def _text(obs, info: dict) -> str:
    """The observation with GEM's task suffix, as its chat wrapper joins them."""
    text = clean_text(str(obs))
    suffix = info.get("suffix") if isinstance(info, dict) else None
    if suffix:
        text = (text if not text or text.endswith("\n") else text + "\n") + clean_text(str(suffix))
    return text


class GemEnv:
    """One episode of a GEM environment (see the module docstring)."""

    name = "gem"
    config = GemConfig
    requires = {"gem": "gem-llm>=0.1.0"}
    extra = "gem"
    runs_code = False
    max_concurrent = 0
    concurrent = False  # the library's calls share the global generators: one at a time (and under a lock anyway)
    returns = "sum"  # GEM's rewards are per step
    failure_return = -0.1  # GEM's reward for a reply it cannot read (LanguageGameReward.format_error_reward)

    def __init__(self, *, max_turns: int = 30, id: str = "game:GuessTheNumber-v0-easy",  # noqa: A002 - the key
                 kwargs: dict[str, Any] | None = None, system_prompt: str = SYSTEM):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.id = id
        self.kwargs = dict(kwargs or {})
        self.system_prompt = system_prompt
        self._env = None
        self._rng = GlobalRandom(numpy=True)
        self.turn = 0
        self.done = False

    @classmethod
    def tasks(cls, split: str, n: int, seed: int, id: str = "game:GuessTheNumber-v0-easy",  # noqa: A002
              **_) -> list[dict]:
        """``n`` seeds of ``split``, drawn from ``seed``: even for "train", odd for "eval" (never the same)."""
        return [{"id": f"{id}-s{s}", "seed": s} for s in split_seeds(split, n, seed)]

    @classmethod
    def check(cls, id: str = "game:GuessTheNumber-v0-easy", kwargs: dict | None = None, **_) -> None:  # noqa: A002
        """On each playing rank: the environment starts here (its data, e.g. NLTK word lists; its arguments)."""
        GemConfig(id=id, kwargs=dict(kwargs or {})).validate()
        try:
            with owning(GlobalRandom(numpy=True)):
                env = _make(id, dict(kwargs or {}), 0)
                env.reset(seed=0)
        except Exception as e:  # noqa: BLE001 - whatever stops it from starting is named in one line
            first = _ANSI.sub("", next((ln.strip() for ln in str(e).splitlines() if ln.strip().strip("*")), ""))
            data = re.search(r"Resource (\S+) not found", first) if isinstance(e, LookupError) else None
            hint = (f" (NLTK data that is not installed: `python -m nltk.downloader {data.group(1)}` where a network "
                    "is reachable)") if data else ""
            raise ValueError(f"env.gem.id: {id} does not start here: {type(e).__name__}: {first[:200]}{hint}") from None

    def reset(self, task: dict):
        seed = task["seed"]
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 32:
            raise ValueError(f"task {task.get('id')!r}: seed must be an integer in [0, 2**32), got {seed!r}")
        self.close()
        self._rng, self.turn, self.done = GlobalRandom(numpy=True), 0, False
        with owning(self._rng):
            random.seed(seed)  # what the constructor draws (it resets itself once, unseeded) follows the task too
            env = _make(self.id, self.kwargs, seed)
            obs, info = env.reset(seed=seed)
        self._env = env
        opening = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return opening + [{"role": "user", "content": _text(obs, info)}], {"id": task.get("id"), "env_id": self.id,
                                                                          "seed": seed}

    def step(self, text: str):
        if self._env is None:
            raise RuntimeError("step() before reset()")
        if self.done:
            return [], 0.0, True, False, {"turn": self.turn, "note": "the episode had ended"}
        self.turn += 1
        info: dict[str, Any] = {"turn": self.turn}
        try:
            with owning(self._rng):
                obs, reward, terminated, truncated, step_info = self._env.step(
                    clean_text(text if isinstance(text, str) else str(text)))
            reward = float(reward)
        except Exception as e:  # noqa: BLE001 - the library failed on the reply: an unreadable one, and the end
            self.done = True
            info["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            return [], self.failure_return, True, False, info
        if reward != reward:
            reward = self.failure_return
            info["error"] = "the library's reward was NaN"
        terminated, truncated = bool(terminated), bool(truncated)
        if terminated:
            self.done = True
            info["outcome"] = clean_text(str(obs))[:500]
            return [], reward, True, truncated, info
        text = _text(obs, step_info)
        if self.turn >= self.max_turns:  # GEM's message may ask for a move: the turn after the last does not exist
            truncated, text = True, f"{text}\n\nOut of turns ({self.turn}/{self.max_turns}): the episode is over."
        self.done = truncated
        return [{"role": "user", "content": text}], reward, False, truncated, info

    def close(self) -> None:
        self._env = None
