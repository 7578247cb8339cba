"""The GEM adapter plays GEM's games and reasoning-gym tasks as the library does: its rewards, RNG and rules."""
import json
import math
import random

import numpy as np
import pytest

pytest.importorskip("gem")

from esopt_mp.envs.libs import gem as adapter  # noqa: E402
from esopt_mp.envs.libs.gem import GemConfig, GemEnv  # noqa: E402


def _library(env_id: str, seed: int, replies: list[str], **make) -> list[tuple]:
    """(obs, reward, terminated, truncated) of each reply, GEM driven directly (its globals seeded as it does)."""
    import gem

    random.seed(seed)
    env = gem.make(env_id, **make)
    env.reset(seed=seed)
    out = []
    for text in replies:
        obs, r, term, trunc, _ = env.step(text)
        out.append((obs, float(r), term, trunc))
        if term or trunc:
            break
    return out


def _guesser():
    """Binary search over GEM's stated range, reading its last hint; ``\\boxed{n}`` actions."""
    state = {}

    def act(text: str) -> str:
        if not state:
            lo, hi = (int(x) for x in text.split("between ")[1].split(" (inclusive)")[0].split(" and "))
            state.update(lo=lo, hi=hi)
        elif "is higher" in text:
            state["lo"] = state["last"] + 1
        elif "is lower" in text:
            state["hi"] = state["last"] - 1
        state["last"] = (state["lo"] + state["hi"]) // 2
        return f"I guess \\boxed{{{state['last']}}}"

    return act


def _hanoi(n: int, a="A", c="C", b="B") -> list[str]:
    return [] if n == 0 else _hanoi(n - 1, a, b, c) + [f"\\boxed{{{a} {c}}}"] + _hanoi(n - 1, b, c, a)


def _play(env: GemEnv, task: dict, policy) -> tuple[list[str], list[tuple]]:
    msgs, _ = env.reset(task)
    replies, out = [], []
    while True:
        replies.append(policy(msgs[-1]["content"]))
        msgs, r, term, trunc, info = env.step(replies[-1])
        out.append((r, term, trunc))
        if term or trunc:
            return replies, out


def test_binary_search_scores_what_gem_scores():
    for task in GemEnv.tasks("train", 5, 0, id="game:GuessTheNumber-v0-hard"):
        env = GemEnv(id="game:GuessTheNumber-v0-hard", max_turns=10)
        replies, ours = _play(env, task, _guesser())
        theirs = _library("game:GuessTheNumber-v0-hard", task["seed"], replies)
        assert ours == [(r, t, tr) for _, r, t, tr in theirs]
        assert theirs[-1][0].startswith("Congratulations")  # binary search over 1..50 wins within 7 guesses
        assert sum(r for r, _, _ in ours) == 1.0  # hints are 0, the win 1: the return is their sum


def test_tower_of_hanoi_solution_and_dense_sum():
    env = GemEnv(id="game:TowerofHanoi-v0-hard", max_turns=40)
    moves = _hanoi(5)
    msgs, _ = env.reset({"id": "t", "seed": 3})
    assert "Tower of Hanoi with 5 disks" in msgs[-1]["content"] and "A: [5, 4, 3, 2, 1]" in msgs[-1]["content"]
    rewards = []
    for m in moves:
        _, r, term, trunc, _ = env.step(m)
        rewards.append(r)
    assert term and len(rewards) == 31 and rewards == [float(r) for _, r, _, _ in _library(
        "game:TowerofHanoi-v0-hard", 3, moves)]
    assert sum(rewards) == 1.0


def test_sudoku_per_move_rewards_are_summed():
    """GEM's Sudoku pays 1/blanks a correct move: the library's own solution, move by move, sums to ~1."""
    import gem

    seed = GemEnv.tasks("eval", 1, 5, id="game:Sudoku-v0-easy")[0]["seed"]
    random.seed(seed)
    lib = gem.make("game:Sudoku-v0-easy")
    lib.reset(seed=seed)
    board, solution = lib.board, lib.full_grid
    moves = [f"\\boxed{{{r + 1} {c + 1} {solution[r][c]}}}" for r in range(4) for c in range(4) if board[r][c] == 0]
    env = GemEnv(id="game:Sudoku-v0-easy", max_turns=20)
    env.reset({"id": "t", "seed": seed})
    rewards = [env.step(m)[1] for m in moves]
    theirs = _library("game:Sudoku-v0-easy", seed, moves)
    assert rewards == [r for _, r, _, _ in theirs] and theirs[-1][2]
    assert math.isclose(sum(rewards), sum(r for _, r, _, _ in theirs)) and sum(rewards) > 0.99


def test_reasoning_gym_item_and_its_score():
    import reasoning_gym

    for task in GemEnv.tasks("train", 3, 1, id="rg:leg_counting"):
        item = reasoning_gym.create_dataset("leg_counting", size=1, seed=task["seed"])[0]
        env = GemEnv(id="rg:leg_counting")
        msgs, _ = env.reset(task)
        assert msgs[-1]["content"] == item["question"]
        _, r, term, _, _ = env.step(f"The total is \\boxed{{{item['answer']}}}.")
        assert (r, term) == (1.0, True)
        env.reset(task)
        assert env.step("\\boxed{-1}")[1] == 0.0


def test_episodes_own_their_randomness():
    """2048 spawns tiles from the global generators: an episode plays the same whether or not another one runs
    beside it, and the caller's global generator states are left as they were."""
    moves = ["\\boxed{up}", "\\boxed{left}", "\\boxed{down}", "\\boxed{right}"] * 4
    tasks = GemEnv.tasks("train", 2, 0, id="game:Game2048-v0-easy")

    def alone():
        env = GemEnv(id="game:Game2048-v0-easy", max_turns=20)
        env.reset(tasks[0])
        return [env.step(m)[0] for m in moves]

    random.seed(123)
    np.random.seed(456)
    before = random.getstate(), np.random.get_state()[1].copy()
    solo = alone()
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()
    a, b = GemEnv(id="game:Game2048-v0-easy", max_turns=20), GemEnv(id="game:Game2048-v0-easy", max_turns=20)
    a.reset(tasks[0])
    b.reset(tasks[1])
    mixed = []
    for m in moves:
        mixed.append(a.step(m)[0])
        b.step(m)
        random.random()  # the caller draws in between
    assert mixed == solo


HOSTILE = ["", "\x00", "\ud800\\boxed{1 1 1}\udfff", "\\boxed{" + "9" * 5000 + "}", "\\boxed{" + "9" * 5000 + " 1 1}",
           "\\boxed{" * 20000, "\\boxed{" + "{" * 5000, "}" * 10000, "a" * 300000, "\\boxed{-1 -1 -1}",
           "\\fbox{2 2 2}", "\\boxed{\\boxed{1 1 1}}"]


@pytest.mark.parametrize("env_id", ["game:Sudoku-v0-easy", "game:Minesweeper-v0-easy", "game:GuessTheNumber-v0-easy",
                                    "game:Sokoban-v0-easy", "rg:leg_counting"])
def test_hostile_text_never_raises(env_id):
    for text in HOSTILE:
        env = GemEnv(id=env_id, max_turns=3)
        env.reset({"id": "t", "seed": 2})
        msgs, r, term, trunc, info = env.step(text)
        assert math.isfinite(r) and isinstance(msgs, list)
        json.dumps(info)


def test_a_library_error_on_the_reply_ends_the_episode(monkeypatch):
    env = GemEnv(id="game:Sudoku-v0-easy", max_turns=5)
    env.reset({"id": "t", "seed": 0})

    def boom(action):
        raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")

    monkeypatch.setattr(env._env, "step", boom)
    msgs, r, term, trunc, info = env.step("\\boxed{1 1 1}")
    assert (msgs, r, term) == ([], GemEnv.failure_return, True) and "4300 digits" in info["error"]
    assert env.step("again")[2] is True


def test_turn_budget_truncates():
    env = GemEnv(id="game:TowerofHanoi-v0-hard", max_turns=2)
    env.reset({"id": "t", "seed": 0})
    assert env.step("\\boxed{A C}")[3] is False
    msgs, r, term, trunc, _ = env.step("\\boxed{A B}")
    assert (term, trunc) == (False, True) and msgs
    assert msgs[-1]["content"].endswith("\n\nOut of turns (2/2): the episode is over.")  # no move asked past it


def test_tasks_deterministic_and_disjoint():
    a = GemEnv.tasks("train", 40, 3, id="game:Sudoku-v0-easy")
    assert a == GemEnv.tasks("train", 40, 3, id="game:Sudoku-v0-easy")
    assert a != GemEnv.tasks("train", 40, 4, id="game:Sudoku-v0-easy")
    held = GemEnv.tasks("eval", 40, 4, id="game:Sudoku-v0-easy")
    assert not {t["seed"] for t in a} & {t["seed"] for t in held}
    # the same task plays the same game
    m1, _ = GemEnv(id="game:Minesweeper-v0-easy").reset(a[0])
    m2, _ = GemEnv(id="game:Minesweeper-v0-easy").reset(a[0])
    m3, _ = GemEnv(id="game:Sudoku-v0-easy").reset(a[1])
    m4, _ = GemEnv(id="game:Sudoku-v0-easy").reset(a[0])
    assert m1 == m2 and m3 != m4
    with pytest.raises(ValueError, match="split"):
        GemEnv.tasks("test", 1, 0)


@pytest.mark.parametrize("cfg,match", [
    ({"id": "math:GSM8K"}, "dataset hub"), ({"id": "qa:HotpotQA"}, "dataset hub"), ({"id": "eval:AMC"}, "dataset hub"),
    ({"id": "Sudoku"}, "not a game"), ({"id": "game:Sudoku-v0-medium"}, "variants of it: game:Sudoku-v0-easy"),
    ({"id": "rg:leg_counting", "kwargs": {"size": 3}}, "kwargs.size"),
    ({"id": "game:Sudoku-v0-easy", "kwargs": {"clue": 3}}, "takes clues, max_turns, scale"),
])
def test_validation_is_one_line(cfg, match):
    with pytest.raises(ValueError, match=match) as e:
        GemConfig(**cfg).validate()
    assert "\n" not in str(e.value)


def test_check_names_what_does_not_start(monkeypatch):
    import gem

    GemEnv.check(id="game:Sudoku-v0-easy")

    def offline(env_id, **kwargs):
        raise LookupError("\n****\n  Resource \x1b[93mwords\x1b[0m not found.\n  Please use the NLTK Downloader\n")

    monkeypatch.setattr(gem, "make", offline)
    with pytest.raises(ValueError, match="nltk.downloader words") as e:
        GemEnv.check(id="game:Wordle-v0-easy")
    assert "\n" not in str(e.value) and "\x1b" not in str(e.value)


