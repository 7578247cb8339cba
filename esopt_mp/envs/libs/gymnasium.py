"""Gymnasium's text-playable environments (``toy_text``): FrozenLake, Taxi, CliffWalking, Blackjack.

``env.name=gymnasium env.gymnasium.id=Taxi-v4`` plays a registered Gymnasium id; ``env.gymnasium.kwargs`` are
``gymnasium.make``'s keyword arguments (FrozenLake: ``is_slippery``, ``map_name``, ``desc``; ``max_episode_steps``
for the time limit). The user message is the library's own text rendering (``render_mode="ansi"``, its terminal
colours turned into words: where the player, the taxi, the passenger and the destination are); Blackjack has no
text rendering, so its observation tuple (hand sum, dealer's card, usable ace) is described in words.

The answer format: one action per reply, inside ``<action>...</action>`` -- its name (FrozenLake ``left``, ``down``,
``right``, ``up``; Taxi ``south``, ``north``, ``east``, ``west``, ``pickup``, ``dropoff``; CliffWalking ``up``,
``right``, ``down``, ``left``; Blackjack ``stick``, ``hit``; case and spaces ignored) or its number (0, 1, ...).
The last such tag counts; a reply that is nothing but the name or number counts too. A reply with no readable
action does not step the game: it spends the turn, scores ``invalid_reward`` (default -1, what a Taxi or
CliffWalking move costs, so that stalling never beats moving) and gets feedback naming the actions.
``answer_format=lenient`` reads a small model that rarely writes the tag: with no tag and no bare answer, the last
action name the reply mentions as a word (``"I will hit now"`` reads ``hit``). Nothing is scored for the form: the
action read plays the game and the game's reward is the only reward.

Every step's reward is the library's (dense for Taxi and CliffWalking) and the episode's return is their sum;
``terminated`` and ``truncated`` are the library's (its ``TimeLimit``), the run's ``max_turns`` truncating too. A
task is a reset seed (even for "train", odd for "eval"); with ``random_map_size`` each FrozenLake task carries its
own map, the library's ``generate_random_map`` of that size seeded by the task.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from esopt_mp.chat.format import clean_text
from esopt_mp.envs.libs.seeds import split_seeds

ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LAST = re.compile(r"^ *\(\w+\) *\n?", re.MULTILINE)  # the render's "(Left)" line: the feedback names the action
_TAG = re.compile(r"<action>\s*([^<]{0,64}?)\s*</action>", re.IGNORECASE)  # bounded: hostile text stays linear
_WORD = re.compile(r"[a-z]+")
FORMATS = ("strict", "lenient")
_FORMAT = "Each turn, reply with exactly one action inside <action>...</action>, for example <action>{eg}</action>."

_GRIDS = ("FrozenLakeEnv", "TaxiEnv", "CliffWalkingEnv")
# the library's action labels by environment class (the order is the action number)
ACTIONS = {
    "FrozenLakeEnv": ("left", "down", "right", "up"),
    "TaxiEnv": ("south", "north", "east", "west", "pickup", "dropoff"),
    "CliffWalkingEnv": ("up", "right", "down", "left"),
    "BlackjackEnv": ("stick", "hit"),
}
RULES = {
    "FrozenLakeEnv": ("You are crossing a frozen lake on a grid: S is the start, F frozen ice (safe), H a hole, G the "
                      "goal. Walk from S to G without falling into a hole; reaching G ends the game with the reward, a "
                      "hole ends it with nothing.{slippery}"),
    "TaxiEnv": ("You drive a taxi on a 5x5 grid; '|' is a wall the taxi cannot cross, ':' open road. The four pads "
                "are R, G, Y and B. Drive to the passenger's pad, pick them up, drive to their destination pad and "
                "drop them off. Every action costs 1, the delivery scores 20, a pickup or dropoff in the wrong place "
                "costs 10. North is up."),
    "CliffWalkingEnv": ("You walk on a 4x12 grid from the start (bottom left) to the goal T (bottom right); C is a "
                        "cliff, o safe ground, x you. Every step costs 1; stepping onto the cliff costs 100 and "
                        "sends you back to the start."),
    "BlackjackEnv": ("You play a hand of Blackjack against the dealer. Cards count their value, face cards 10, an "
                     "ace 1 or 11. Hit to draw a card, stick to stop; then the dealer draws to 17 or more. Closer "
                     "to 21 than the dealer without going over wins 1, a draw 0, a loss or going over 21 -1."),
}


def _gym():
    try:
        import gymnasium
    except ImportError:
        raise ValueError("the gymnasium environment needs gymnasium: pip install 'esopt_mp[gymnasium]'") from None
    return gymnasium


def _env_class(env_id: str):
    """The environment class a registered id builds (without building one)."""
    from gymnasium.envs.registration import load_env_creator

    entry = _gym().spec(env_id).entry_point
    return load_env_creator(entry) if isinstance(entry, str) else entry


def _kind(cls) -> str | None:
    """The toy_text environment ``cls`` is (or subclasses), by its class name in :data:`ACTIONS`."""
    for c in getattr(cls, "__mro__", ()):
        if c.__name__ in ACTIONS and c.__module__.startswith("gymnasium.envs.toy_text"):
            return c.__name__
    return None


def _texty(cls) -> bool:
    return _kind(cls) == "BlackjackEnv" or "ansi" in (getattr(cls, "metadata", None) or {}).get("render_modes", ())


@dataclasses.dataclass
class GymnasiumConfig:
    """The ``env.gymnasium`` section."""

    id: str = "FrozenLake-v1"  # a registered Gymnasium id with a text rendering (toy_text)
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # gymnasium.make's keyword arguments, e.g.
    # is_slippery, map_name ("4x4", "8x8"), desc, max_episode_steps
    random_map_size: int = 0  # FrozenLake: every task its own random map of this size (0: the map of kwargs)
    invalid_reward: float = -1.0  # the reward of a reply with no readable action (the game does not move)
    system_prompt: str | None = None  # the opening system message (None: the game's rules and the answer format;
    # '' sends none)
    answer_format: str = "strict"  # strict: a tag or a bare name/number; lenient: else the last action name mentioned

    def validate(self, key: str = "env.gymnasium") -> None:
        gym = _gym()
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"{key}.id: expected a Gymnasium id such as FrozenLake-v1, got {self.id!r}")
        try:
            cls = _env_class(self.id)
        except Exception as e:  # noqa: BLE001 - an unknown id, or an entry point that does not import
            toy = sorted(k for k, s in gym.registry.items() if "toy_text" in str(s.entry_point))
            why = ANSI.sub("", str(e)).splitlines()[0][:160] if str(e) else type(e).__name__
            raise ValueError(f"{key}.id: {self.id!r}: {why}; the text-playable ids: {', '.join(toy)}") from None
        if not _texty(cls):
            toy = sorted(k for k, s in gym.registry.items() if "toy_text" in str(s.entry_point))
            raise ValueError(f"{key}.id: {self.id} has no text rendering (render_mode='ansi'); the text-playable ids: "
                             f"{', '.join(toy)}")
        if not isinstance(self.kwargs, dict) or not all(isinstance(k, str) for k in self.kwargs):
            raise ValueError(f"{key}.kwargs: expected a mapping of gymnasium.make's arguments, got {self.kwargs!r}")
        if "render_mode" in self.kwargs:
            raise ValueError(f"{key}.kwargs.render_mode: set by the environment (the text rendering)")
        if isinstance(self.random_map_size, bool) or not isinstance(self.random_map_size, int) or not (
                self.random_map_size == 0 or 2 <= self.random_map_size <= 64):
            raise ValueError(f"{key}.random_map_size: expected 0 or a side of 2 to 64, got {self.random_map_size!r}")
        if self.random_map_size and _kind(cls) != "FrozenLakeEnv":
            raise ValueError(f"{key}.random_map_size: only FrozenLake has random maps, not {self.id}")
        if self.random_map_size and ("desc" in self.kwargs or "map_name" in self.kwargs):
            raise ValueError(f"{key}.random_map_size: each task brings its own map; drop kwargs.desc / map_name")
        if self.answer_format not in FORMATS:
            raise ValueError(f"{key}.answer_format: one of {', '.join(FORMATS)}, got {self.answer_format!r}")
        if not (self.invalid_reward == self.invalid_reward and abs(self.invalid_reward) < float("inf")):
            raise ValueError(f"{key}.invalid_reward: expected a finite number, got {self.invalid_reward!r}")


def parse_action(text: str, names: tuple[str, ...], n: int, answer_format: str = "strict") -> int | None:
    """The action number ``text`` names (see the module docstring), or None."""
    found = _TAG.findall(text)
    word = found[-1] if found else text.strip()
    word = re.sub(r"[\s_\-]+", "", word).strip(".").lower()
    if word and len(word) <= 16:
        if re.fullmatch(r"[0-9]{1,3}", word):
            return int(word) if int(word) < n else None
        if word in names:
            return names.index(word)
    if answer_format == "lenient" and not found and names:
        mentioned = [w for w in _WORD.findall(text.lower()) if w in names]
        return names.index(mentioned[-1]) if mentioned else None
    return None


def _jsonable(obs):
    """The observation as JSON (ints, tuples of ints)."""
    if isinstance(obs, tuple):
        return [_jsonable(x) for x in obs]
    try:
        return int(obs)
    except (TypeError, ValueError):
        return str(obs)


class GymnasiumEnv:
    """One episode of a Gymnasium toy_text environment played as text (see the module docstring)."""

    name = "gymnasium"
    config = GymnasiumConfig
    requires = {"gymnasium": "gymnasium>=1.0"}
    extra = "gymnasium"
    runs_code = False
    max_concurrent = 0
    concurrent = False  # in-process and quick: nothing to wait on
    returns = "sum"  # dense rewards (Taxi, CliffWalking)

    def __init__(self, *, max_turns: int = 30, id: str = "FrozenLake-v1",  # noqa: A002 - the section's key
                 kwargs: dict[str, Any] | None = None, random_map_size: int = 0, invalid_reward: float = -1.0,
                 system_prompt: str | None = None, answer_format: str = "strict"):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.id = id
        self.kwargs = dict(kwargs or {})
        self.random_map_size = random_map_size
        self.invalid_reward = float(invalid_reward)
        self.system_prompt = system_prompt
        self.answer_format = answer_format
        self.failure_return = self.invalid_reward * max_turns  # refined at reset: the lowest return possible
        self._env = None
        self.turn = 0
        self.done = False

    @classmethod
    def tasks(cls, split: str, n: int, seed: int, id: str = "FrozenLake-v1",  # noqa: A002
              random_map_size: int = 0, **_) -> list[dict]:
        """``n`` reset seeds of ``split`` drawn from ``seed`` (even for "train", odd for "eval"); with
        ``random_map_size`` each task's FrozenLake map too."""
        tasks = [{"id": f"{id}-s{s}", "seed": s} for s in split_seeds(split, n, seed)]
        if random_map_size:
            from gymnasium.envs.toy_text.frozen_lake import generate_random_map

            for t in tasks:
                t["desc"] = generate_random_map(size=random_map_size, seed=t["seed"])
        return tasks

    @classmethod
    def check(cls, id: str = "FrozenLake-v1", kwargs: dict | None = None, random_map_size: int = 0,  # noqa: A002
              **_) -> None:
        """On each playing rank: the environment builds with these arguments and its actions are discrete."""
        env = cls(max_turns=1, id=id, kwargs=kwargs, random_map_size=random_map_size)
        try:
            env.reset(cls.tasks("train", 1, 0, id=id, random_map_size=random_map_size)[0])
        except Exception as e:  # noqa: BLE001 - a bad argument, a continuous action space: one line
            raise ValueError(f"env.gymnasium: {id} does not start with kwargs {kwargs or {}}: {type(e).__name__}: "
                             f"{ANSI.sub('', str(e)).splitlines()[0][:200] if str(e) else ''}") from None
        finally:
            env.close()

    # -- the game as text --
    def _build(self, task: dict):
        gym = _gym()
        from gymnasium import spaces

        kwargs = dict(self.kwargs)
        if "desc" in task:
            kwargs["desc"] = list(task["desc"])
        ansi = "ansi" in (getattr(_env_class(self.id), "metadata", None) or {}).get("render_modes", ())
        env = gym.make(self.id, render_mode="ansi" if ansi else None, **kwargs)
        if not isinstance(env.action_space, spaces.Discrete):
            env.close()
            raise ValueError(f"{self.id}'s actions are not discrete ({env.action_space}): no text answer names one")
        self._ansi = ansi
        self._kind = _kind(type(env.unwrapped))
        self._n = int(env.action_space.n)
        self._start = int(env.action_space.start)
        self._names = ACTIONS.get(self._kind, ())
        return env

    def _lowest_return(self) -> float:
        """The lowest return an episode of ``max_turns`` turns can score: what a failed episode scores."""
        u = self._env.unwrapped
        table = getattr(u, "P", None)
        if isinstance(table, dict):
            low = min(t[2] for by_action in table.values() for outcomes in by_action.values() for t in outcomes)
        else:
            low = -1.0  # Blackjack: a lost hand
        return self.max_turns * min(float(low), self.invalid_reward)

    def _actions_text(self) -> str:
        if self._names:
            return ", ".join(f"{name} ({i})" for i, name in enumerate(self._names))
        return f"a number from 0 to {self._n - 1}"

    def _system(self) -> str:
        if self.system_prompt is not None:
            return self.system_prompt
        rules = RULES.get(self._kind, f"You are playing the Gymnasium environment {self.id}.")
        if self._kind == "FrozenLakeEnv":
            table = self._env.unwrapped.P
            slippery = any(len(outcomes) > 1 for by_action in table.values() for outcomes in by_action.values())
            rules = rules.format(slippery=" The ice is slippery: a move may slide you to either side of the "
                                          "direction you chose." if slippery else "")
        eg = self._names[0] if self._names else "0"
        return (f"{rules}\n{_FORMAT.format(eg=eg)} Actions: {self._actions_text()}."
                + ("\nRows and columns count from 1 at the top left." if self._kind in _GRIDS else ""))

    def _observation(self, obs) -> str:
        u = self._env.unwrapped
        board = _LAST.sub("", ANSI.sub("", self._env.render())).strip("\n") if self._ansi else ""
        if self._kind == "FrozenLakeEnv":
            row, col = divmod(int(obs), u.ncol)
            tile = u.desc[row, col].decode()
            where = f"You are at row {row + 1}, column {col + 1}, on {tile}."
        elif self._kind == "TaxiEnv":
            row, col, passenger, dest = u.decode(int(obs))
            pads = "RGYB"
            who = "in the taxi" if passenger == 4 else f"waiting at {pads[passenger]}"
            where = f"Taxi at row {row + 1}, column {col + 1}. Passenger {who}; destination {pads[dest]}."
        elif self._kind == "CliffWalkingEnv":
            row, col = divmod(int(obs), u.shape[1])
            where = f"You (x) are at row {row + 1}, column {col + 1}."
        elif self._kind == "BlackjackEnv":
            player, dealer, ace = obs
            where = (f"Your cards sum to {int(player)}{' (with an ace counted as 11)' if ace else ''}. The dealer "
                     f"shows {'an ace' if int(dealer) == 1 else int(dealer)}.")
        else:
            where = f"Observation: {_jsonable(obs)}"
        return "\n".join(p for p in (board, where) if p)

    def _prompt(self, obs, feedback: str | None, end: str | None = None) -> str:
        """The next turn's user message; ``end``: the episode was cut short, said in place of asking for an action
        (the turn after the last one does not exist)."""
        parts = [feedback] if feedback else []
        parts += [self._observation(obs), end or f"Turn {self.turn + 1}/{self.max_turns}. Your action:"]
        return "\n".join(parts)

    # -- the protocol --
    def reset(self, task: dict):
        seed = task["seed"]
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"task {task.get('id')!r}: seed must be a non-negative integer, got {seed!r}")
        self.close()
        self._env = self._build(task)
        self.failure_return = self._lowest_return()
        self.turn, self.done = 0, False
        self._obs, _ = self._env.reset(seed=seed)
        system = self._system()
        opening = [{"role": "system", "content": system}] if system else []
        return opening + [{"role": "user", "content": self._prompt(self._obs, None)}], {
            "id": task.get("id"), "env_id": self.id, "seed": seed, "obs": _jsonable(self._obs)}

    def step(self, text: str):
        if self._env is None:
            raise RuntimeError("step() before reset()")
        if self.done:
            return [], 0.0, True, False, {"turn": self.turn, "note": "the episode had ended"}
        self.turn += 1
        action = parse_action(clean_text(text if isinstance(text, str) else str(text)), self._names, self._n,
                              self.answer_format)
        info: dict[str, Any] = {"turn": self.turn, "valid_action": action is not None}
        if action is None:
            reward, terminated, truncated = self.invalid_reward, False, False
            feedback = f"No action read (reply <action>NAME</action>): nothing moved; reward {self.invalid_reward:g}."
        else:
            self._obs, reward, terminated, truncated, _ = self._env.step(self._start + action)
            reward, terminated, truncated = float(reward), bool(terminated), bool(truncated)
            label = self._names[action] if self._names else str(action)
            feedback = f"You chose {label}; reward {reward:g}."
            info["action"] = action
        info["obs"] = _jsonable(self._obs)
        if terminated:
            self.done = True
            info["outcome"] = self._observation(self._obs)
            return [], reward, True, truncated, info
        end = None
        if self.turn >= self.max_turns:
            truncated, end = True, f"Out of turns ({self.turn}/{self.max_turns}): the episode is over."
        elif truncated:  # the library's own step limit (its TimeLimit wrapper) came first
            end = f"{self.id}'s own step limit ended the episode (turn {self.turn}/{self.max_turns})."
        self.done = truncated
        return [{"role": "user", "content": self._prompt(self._obs, feedback, end)}], reward, False, truncated, info

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
