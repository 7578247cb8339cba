"""TextArena's single-player games: one game instance per episode, its own observations, rules and reward.

``env.textarena.game`` is a TextArena id (``GuessTheNumber-v0``, ``2048-v0-mega-easy``, ``Minesweeper-v0-small``,
``TowerOfHanoi-v0``, ``Sudoku-v0-easy``...). A task is a game seed; the training and held-out seeds never meet
(even and odd). The player's observation since its last turn (what the game said: its prompt, the board, hints,
an invalid-move warning; not the echo of the reply) is the user message, the reply is the action as the game's
own wrappers read it, and the return is the reward the game gives when it ends (``close()``). Invalid moves are
the game's business: it warns, and a second one in a row usually ends the game with its own score. An episode
the turn budget cuts short scores what the game scores a game its own turn limit ends (its completion fraction:
disks in place, tiles reached, the distance of the last guess), 0 for a game that has no such score. With
``partial_credit=false`` a score strictly between 0 and 1 (a lost game's completion) counts 0: only a win (1)
scores, and a game's own -1 (an invalid-move loss in some games) stays -1.

The library draws from the process-global ``random`` (seeded at each reset, drawn again in steps: 2048 spawns
tiles, Minesweeper lays mines on the first reveal), so every call into it runs on the episode's own saved
generator state under one process-wide lock (:mod:`esopt_mp.envs.libs.global_rng`), the caller's restored
after: an episode plays the same whatever runs beside it, and nobody else's draws move. Games that download NLTK word lists when they load (Wordle, Hangman,
WordLadder, Codenames...) are refused unless that data is installed; games for two or more players, or that call
a hosted model, are refused at validation.
"""
from __future__ import annotations

import dataclasses
import inspect
import pathlib
import random
import re
from typing import Any

from esopt_mp.envs.libs.global_rng import GlobalRandom, owning
from esopt_mp.chat.format import clean_text
from esopt_mp.envs.libs.seeds import split_seeds

SYSTEM = ("You are playing a text game. Read the game's messages and reply each turn with one move, in the "
          "format the game asks for (usually in square brackets, e.g. [5]).")
_NLTK_CALL = re.compile(r"nltk\.download\(\s*(\[[^\]]*\]|'[^']*'|\"[^\"]*\")")
_NLTK_DIRS = ("corpora", "taggers", "tokenizers", "chunkers", "models")
_PROBED: set = set()  # (game, game_kwargs, error_allowance) that started here


def _registry() -> dict:
    try:
        from textarena.envs.registration import ENV_REGISTRY
    except ImportError:
        raise ValueError("the textarena environment needs textarena: pip install 'esopt_mp[textarena]'") from None
    return ENV_REGISTRY


def _module_files(entry_point) -> list[pathlib.Path]:
    """The source files of a game's package, found without importing it (some games' modules do not compile)."""
    import textarena

    module = entry_point.split(":")[0] if isinstance(entry_point, str) else entry_point.__module__
    root = pathlib.Path(textarena.__file__).parent.parent
    folder = root.joinpath(*module.split(".")).parent
    return sorted(folder.rglob("*.py")) if folder.is_dir() else []


def nltk_missing(game: str) -> list[str]:
    """The NLTK resources ``game`` downloads when it loads (its own calls and its word-list helper's) that are not
    installed; offline the download fails and the game with it. Empty for the games that use no NLTK data."""
    import textarena

    files = _module_files(_registry()[game].entry_point)
    texts = [f.read_text(errors="replace") for f in files]
    if any("word_lists" in t or "EnglishDictionary" in t for t in texts):
        helper = pathlib.Path(textarena.__file__).parent / "envs" / "utils" / "word_lists.py"
        texts.append(helper.read_text(errors="replace"))
    calls = [call for t in texts for call in _NLTK_CALL.findall(t)]
    wanted = sorted({name for call in calls for name in re.findall(r"['\"]([^'\"]+)['\"]", call)})
    if not wanted:
        return []
    try:
        import nltk
    except ImportError:
        return wanted

    def installed(name: str) -> bool:
        for d in _NLTK_DIRS:
            try:
                nltk.data.find(f"{d}/{name}")
                return True
            except LookupError:
                continue
        return False

    return [name for name in wanted if not installed(name)]


def _unwrapped(env):
    """The game under TextArena's wrappers: its ``get_observation`` gives the raw messages since the last turn."""
    import textarena as ta

    while isinstance(env, ta.Wrapper):
        env = env.env
    return env


def _render(messages) -> tuple[str, bool]:
    """(the messages the player has not seen, as text; whether one is an invalid-move warning). The echo of the
    player's own action is left out: the reply is already in the conversation."""
    import textarena as ta

    parts, invalid = [], False
    for _, text, kind in messages:
        if kind == ta.ObservationType.PLAYER_ACTION:
            continue
        invalid |= kind == ta.ObservationType.GAME_ADMIN and "invalid move" in str(text).lower()
        text = str(text).strip("\n").rstrip()
        if text:
            parts.append(text)
    return "\n\n".join(parts), invalid


@dataclasses.dataclass
class TextArenaConfig:
    """The ``env.textarena`` section."""

    game: str = "GuessTheNumber-v0"  # a TextArena id (its registry), single-player, playable offline
    game_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # the game class's own arguments, over
    # the id's (GuessTheNumber: min_number, max_number, max_turns -- the game's own turn limit)
    system_prompt: str = SYSTEM  # the opening system message ('' sends none)
    error_allowance: int | None = None  # invalid moves in a row the game forgives (None: the game's own, 1 for
    # most: a second one ends it); a larger one lets a weak player's bad replies be feedback, not the end
    partial_credit: bool = True  # a lost game scores the game's own completion in (0, 1) (GuessTheNumber: how near
    # the last valid guess was); false: such a score counts 0, so in games that pay 1 for a win only a win scores

    def validate(self, key: str) -> None:
        probe(self, key)


def probe(cfg: TextArenaConfig, key: str = "env.textarena") -> None:
    """Refuse, with one line naming why, a game that is not registered, takes other arguments, needs NLTK data
    that is not installed, does not start here (a hosted model's key, a broken module) or is not single-player.
    Starts one instance, once per process and settings (on a saved and restored ``random``)."""
    registry = _registry()
    game = cfg.game
    key_of = (game, repr(sorted(cfg.game_kwargs.items())) if isinstance(cfg.game_kwargs, dict) else None,
              cfg.error_allowance)
    if key_of in _PROBED:  # a game that started once in this process starts again (some take seconds to build)
        return
    if game not in registry:
        near = sorted(k for k in registry if k.split("-")[0].lower() == game.split("-")[0].lower())
        raise ValueError(f"{key}.game: {game!r} is not a TextArena id; "
                         + (f"variants of it: {', '.join(near)}" if near else f"{len(registry)} ids are registered, "
                            "e.g. GuessTheNumber-v0, 2048-v0-mega-easy, Minesweeper-v0-small, TowerOfHanoi-v0"))
    missing = nltk_missing(game)
    if missing:
        raise ValueError(f"{key}.game: {game} loads NLTK data that is not installed ({', '.join(missing)}): the "
                         "library downloads it when the game loads, which fails offline; install it with `python -m "
                         f"nltk.downloader {' '.join(missing)}` where a network is reachable, or pick another game")
    if cfg.error_allowance is not None and cfg.error_allowance < 0:
        raise ValueError(f"{key}.error_allowance: must be >= 0 or null, got {cfg.error_allowance}")
    if not isinstance(cfg.game_kwargs, dict):
        raise ValueError(f"{key}.game_kwargs: expected a mapping, got {cfg.game_kwargs!r}")
    import textarena as ta

    def no_start(e: Exception) -> ValueError:
        first = (str(e).strip().splitlines() or [""])[0]
        return ValueError(f"{key}.game: {game} does not start as a one-player game here: {type(e).__name__}: "
                          f"{first[:200]}")

    try:
        game_cls = _entry_class(registry[game].entry_point)
    except Exception as e:  # noqa: BLE001 - a module that does not import (or compile) is named in one line
        raise no_start(e) from None
    params = inspect.signature(game_cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        bad = [k for k in cfg.game_kwargs if k not in params or k == "self"]
        if bad:
            known = [p for p in params if p != "self"]
            raise ValueError(f"{key}.game_kwargs: {game_cls.__name__} takes {', '.join(known) or 'no arguments'}; "
                             f"unknown: {', '.join(bad)}")
    try:
        with owning(GlobalRandom()):
            env = ta.make(game, **cfg.game_kwargs)
            env.reset(num_players=1, seed=0)
            state = getattr(_unwrapped(env), "state", None)
    except Exception as e:  # noqa: BLE001 - whatever stops the game from starting (a hosted model's key, a bad
        raise no_start(e) from None  # argument value) is named in one line
    if not isinstance(state, ta.SinglePlayerState):
        kind = type(state).__name__ if state is not None else "no state"
        raise ValueError(f"{key}.game: {game} ({game_cls.__name__}, {kind}) is not a single-player game; only "
                         "single-player games are played (there is no opponent policy)")
    _PROBED.add(key_of)


def _entry_class(entry_point):
    if not isinstance(entry_point, str):
        return entry_point
    import importlib

    module, _, name = entry_point.partition(":")
    return getattr(importlib.import_module(module), name)


class TextArenaEnv:
    """One episode of a TextArena single-player game (see the module docstring)."""

    name = "textarena"
    config = TextArenaConfig
    requires = {"textarena": "textarena>=0.7.4"}
    extra = "textarena"
    runs_code = False
    max_concurrent = 0
    concurrent = False  # the library's calls share the global `random`: one at a time (and under a lock anyway)
    returns = "last"  # the game's reward at its end
    failure_return = -1.0  # the library's lowest single-player reward (a game lost by invalid moves)
    hashed_when_set = {"partial_credit": True}  # at its default, runs from before the field keep their hash

    def __init__(self, *, max_turns: int = 30, game: str = "GuessTheNumber-v0",
                 game_kwargs: dict[str, Any] | None = None, system_prompt: str = SYSTEM,
                 error_allowance: int | None = None, partial_credit: bool = True):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.game = game
        self.game_kwargs = dict(game_kwargs or {})
        self.system_prompt = system_prompt
        self.error_allowance = error_allowance
        self.partial_credit = partial_credit
        self._env = self._game = None
        self._rng = GlobalRandom()
        self.turn = 0
        self.done = False

    @classmethod
    def tasks(cls, split: str, n: int, seed: int, game: str = "GuessTheNumber-v0", **_) -> list[dict]:
        """``n`` game seeds of ``split``, drawn from ``seed``: even for "train", odd for "eval" (never the same)."""
        return [{"id": f"{game}-s{s}", "seed": s} for s in split_seeds(split, n, seed)]

    @classmethod
    def check(cls, **section) -> None:
        """On each playing rank: the game starts there (its NLTK data, its modules)."""
        fields = {f.name for f in dataclasses.fields(TextArenaConfig)}
        probe(TextArenaConfig(**{k: v for k, v in section.items() if k in fields}))

    def reset(self, task: dict):
        import textarena as ta

        seed = task["seed"]
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"task {task.get('id')!r}: seed must be an integer, got {seed!r}")
        self.close()
        self._rng, self.turn, self.done = GlobalRandom(), 0, False
        with owning(self._rng):
            random.seed(seed)  # a game drawing before it seeds its state draws from the task's seed too
            env = ta.make(self.game, **self.game_kwargs)
            env.reset(num_players=1, seed=seed)
            game = _unwrapped(env)
            if self.error_allowance is not None:
                game.state.error_allowance = self.error_allowance
            _, messages = game.get_observation()
        self._env, self._game = env, game
        text, _ = _render(messages)
        opening = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return opening + [{"role": "user", "content": text}], {"id": task.get("id"), "game": self.game,
                                                                 "seed": seed}

    def step(self, text: str):
        if self._env is None:
            raise RuntimeError("step() before reset()")
        if self.done:
            return [], 0.0, True, False, {"turn": self.turn, "note": "the game had ended"}
        self.turn += 1
        info: dict[str, Any] = {"turn": self.turn}
        try:
            with owning(self._rng):
                done, step_info = self._env.step(clean_text(text if isinstance(text, str) else str(text)))
                _, messages = self._game.get_observation()
                rewards, game_info = self._env.close() if done else (None, None)
        except Exception as e:  # noqa: BLE001 - the library failed on the reply (e.g. int() of 5000 digits)
            self.done = True
            info.update(valid_action=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            return [], self.failure_return, True, False, info
        feedback, invalid = _render(messages)
        info["valid_action"] = not invalid
        if step_info:
            info["game"] = {str(k): v for k, v in step_info.items() if isinstance(v, (str, int, float, bool))}
        if done:
            self.done = True
            reward = float((rewards or {}).get(0, 0.0))
            if not self.partial_credit and 0.0 < reward < 1.0:  # a lost game's completion score
                reward = 0.0
            player = (game_info or {}).get(0, {})
            info.update(reason=player.get("reason"), invalid_move=bool(player.get("invalid_move")),
                        turn_count=player.get("turn_count"))
            info["valid_action"] &= not info["invalid_move"]  # the invalid move that ended it sends no warning
            end = "\n\n".join(p for p in (feedback, f"Game over: {player.get('reason')}") if p)
            return [{"role": "user", "content": end}], reward, True, False, info
        reward, truncated = 0.0, self.turn >= self.max_turns
        if truncated:  # cut short: what the game scores a game it cuts short (its turn limit), where it has that
            score = getattr(self._game, "_get_percentage_completion", None)
            if callable(score) and self.partial_credit:
                try:
                    with owning(self._rng):
                        reward = float(score())
                    info["truncation_score"] = reward
                except Exception as e:  # noqa: BLE001 - no score of a game cut short: 0, as for a game without one
                    info["truncation_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            # the game's message may ask for a move: the turn after the last one does not exist
            feedback = "\n\n".join(p for p in (feedback, f"Out of turns ({self.turn}/{self.max_turns}): the episode "
                                                         "is over.") if p)
        return ([{"role": "user", "content": feedback or "(the game sent no message) Your move:"}], reward, False,
                truncated, info)

    def close(self) -> None:
        self._env = self._game = None
