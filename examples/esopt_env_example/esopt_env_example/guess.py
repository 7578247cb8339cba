"""Guess the hidden number in [1, high], told "higher" or "lower" after each guess: a multi-turn episode whose
return is 1 when the number is found within the turns, else 0. The whole plugin an esopt_mp environment needs."""
import dataclasses
import random
import re


@dataclasses.dataclass
class GuessConfig:
    """The section ``env.guess_number.*``: typed, with defaults, checked before training starts."""

    high: int = 16

    def validate(self, key: str) -> None:
        if self.high < 2:
            raise ValueError(f"{key}.high: must be >= 2, got {self.high}")


class GuessNumber:
    """Built with its section's keys for each episode; ``tasks`` is its task source."""

    config = GuessConfig
    returns = "last"  # the episode's return: the last step's reward (the default; "sum" adds up dense rewards)

    def __init__(self, max_turns: int = 6, high: int = 16):
        self.max_turns, self.high = max_turns, high

    @classmethod
    def tasks(cls, split: str, n: int, seed: int, high: int = 16) -> list[dict]:
        rng = random.Random(f"{split}:{seed}")  # train and eval draw from their own streams
        return [{"id": f"{split}-{seed}-{i}", "target": rng.randint(1, high)} for i in range(n)]

    def reset(self, task: dict):
        self.target, self.turn = int(task["target"]), 0
        system = f"Guess the hidden integer between 1 and {self.high}. Reply with one number per turn."
        return [{"role": "system", "content": system}, {"role": "user", "content": "Your first guess?"}], {}

    def step(self, text: str):
        self.turn += 1
        found = re.search(r"-?\d{1,9}", text)  # any text is a move: no number is a wasted turn, never an error
        if found and int(found.group()) == self.target:
            return [], 1.0, True, False, {"turns": self.turn}
        hint = "No number found." if not found else "Higher." if int(found.group()) < self.target else "Lower."
        done = self.turn >= self.max_turns
        return [{"role": "user", "content": f"{hint} Guess again."}], 0.0, False, done, {"turns": self.turn}
