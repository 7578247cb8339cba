"""The TextArena adapter plays a game exactly as the library does: its rewards, its RNG, its rules."""
import math
import random

import pytest

ta = pytest.importorskip("textarena")

from esopt_mp.envs.libs.textarena import TextArenaConfig, TextArenaEnv, nltk_missing, probe  # noqa: E402


def _guesser(lo: int, hi: int):
    """Binary search over [lo, hi] reading the game's last hint; ``[n]`` actions."""
    state = {"lo": lo, "hi": hi, "last": None}

    def act(text: str) -> str:
        if state["last"] is not None:
            if text.rfind("higher") > text.rfind("lower"):
                state["lo"] = state["last"] + 1
            else:
                state["hi"] = state["last"] - 1
        state["last"] = (state["lo"] + state["hi"]) // 2
        return f"My guess: [{state['last']}]"

    return act


def _hanoi(n: int, a="A", c="C", b="B") -> list[str]:
    return [] if n == 0 else _hanoi(n - 1, a, b, c) + [f"[{a} {c}]"] + _hanoi(n - 1, b, c, a)


def _library(game: str, seed: int, policy, kwargs=None, limit: int = 200):
    """(reward, turns, game_info) of ``policy`` playing the library's own env directly, its wrappers included."""
    env = ta.make(game, **(kwargs or {}))
    env.reset(num_players=1, seed=seed)
    done, turns = False, 0
    while not done and turns < limit:
        _, obs = env.get_observation()
        done, _ = env.step(policy(obs))
        turns += 1
    rewards, info = env.close()
    return (rewards or {}).get(0), turns, info[0]


def _adapter(game: str, seed: int, policy, kwargs=None, max_turns: int = 200, **opts):
    """(return, turns, last info) of ``policy`` playing the adapter."""
    env = TextArenaEnv(max_turns=max_turns, game=game, game_kwargs=kwargs or {}, **opts)
    msgs, _ = env.reset({"seed": seed})
    text = msgs[-1]["content"]
    for turn in range(1, max_turns + 1):
        msgs, reward, term, trunc, info = env.step(policy(text))
        if term or trunc:
            return reward, turn, info
        text = msgs[-1]["content"]
    raise AssertionError("the episode did not end")


@pytest.mark.parametrize("seed", [0, 7, 12345])
def test_binary_search_scores_what_the_library_scores(seed):
    kw = {"min_number": 1, "max_number": 1000, "max_turns": 12}
    ref = _library("GuessTheNumber-v0", seed, _guesser(1, 1000), kw)
    got = _adapter("GuessTheNumber-v0", seed, _guesser(1, 1000), kw)
    assert ref[0] == 1 and got[0] == 1.0 and got[1] == ref[1] and got[2]["turn_count"] == ref[2]["turn_count"]
    # a guesser that keeps guessing too low runs out of turns: the library's partial score, not 0 or 1
    kw3 = {"min_number": 1, "max_number": 1000, "max_turns": 3}
    ref = _library("GuessTheNumber-v0", seed, lambda _, it=iter(range(1, 9)): f"[{next(it)}]", kw3)
    got = _adapter("GuessTheNumber-v0", seed, lambda _, it=iter(range(1, 9)): f"[{next(it)}]", kw3)
    assert 0 < ref[0] < 1 and got[0] == ref[0] and got[1] == ref[1]


def test_without_partial_credit_only_a_win_scores():
    kw = {"min_number": 1, "max_number": 1000, "max_turns": 3}
    low = lambda: (lambda _, it=iter(range(1, 9)): f"[{next(it)}]")  # noqa: E731 - a fresh guesser per game
    assert 0 < _adapter("GuessTheNumber-v0", 7, low(), kw)[0] < 1  # the game's own limit ends it: partial
    assert _adapter("GuessTheNumber-v0", 7, low(), kw, partial_credit=False)[0] == 0.0
    kw12 = dict(kw, max_turns=12)  # max_turns cuts it short before the game's limit
    assert 0 < _adapter("GuessTheNumber-v0", 7, low(), kw12, max_turns=3)[0] < 1
    assert _adapter("GuessTheNumber-v0", 7, low(), kw12, max_turns=3, partial_credit=False)[0] == 0.0
    assert _adapter("GuessTheNumber-v0", 7, _guesser(1, 1000), kw12, partial_credit=False)[0] == 1.0


def test_scripted_hanoi_wins_and_two_invalid_moves_lose_as_the_library_says():
    moves = _hanoi(3)
    ref = _library("TowerOfHanoi-v0", 3, lambda _, it=iter(moves): next(it))
    got = _adapter("TowerOfHanoi-v0", 3, lambda _, it=iter(moves): next(it))
    assert ref[0] == 1 and got[0] == 1.0 and got[1] == ref[1] == 7 and got[2]["valid_action"]
    # the library warns once, then ends the game on the second invalid move in a row with its own score
    ref = _library("TowerOfHanoi-v0", 3, lambda _: "set 1 2 3")
    got = _adapter("TowerOfHanoi-v0", 3, lambda _: "set 1 2 3")
    assert got[:2] == (ref[0], ref[1]) and ref[1] == 2 and got[2]["invalid_move"] and not got[2]["valid_action"]
    env = TextArenaEnv(game="TowerOfHanoi-v0")
    env.reset({"seed": 3})
    msgs, reward, term, trunc, info = env.step("no move here")
    assert not (term or trunc) and not info["valid_action"] and "invalid move" in msgs[0]["content"]
    # a larger allowance keeps the game going through bad replies
    got = _adapter("TowerOfHanoi-v0", 3, lambda _: "nothing", max_turns=6, error_allowance=10)
    assert got[1] == 6 and got[0] == 0.0


def test_cut_short_scores_the_games_own_completion():
    """The turn budget ends the episode where the game's own limit would: the same completion score."""
    moves = ["[A C]", "[A B]", "[C B]", "[A C]"]  # disk 3 on C: one disk of three in place
    # the game checks its limit before counting the move: its max_turns=3 ends it after the fourth
    ref = _library("TowerOfHanoi-v0", 1, lambda _, it=iter(moves): next(it), {"num_disks": 3, "max_turns": 3})
    got = _adapter("TowerOfHanoi-v0", 1, lambda _, it=iter(moves): next(it), max_turns=4)
    assert ref[:2] == (1 / 3, 4) and got[:2] == ref[:2] and got[2]["truncation_score"] == ref[0]


def test_the_last_turns_message_says_the_episode_is_over():
    env = TextArenaEnv(max_turns=2, game="TowerOfHanoi-v0", game_kwargs={"num_disks": 3})
    env.reset({"seed": 1})
    msgs, _, term, trunc, _ = env.step("[A C]")
    assert (term, trunc) == (False, False) and "Out of turns" not in msgs[-1]["content"]
    msgs, _, term, trunc, _ = env.step("[A B]")
    assert (term, trunc) == (False, True)
    assert msgs[-1]["content"].endswith("\n\nOut of turns (2/2): the episode is over.")


def test_random_games_replay_under_interleaving_and_leave_global_random_alone():
    """2048 spawns tiles from the global ``random`` in every step, Minesweeper lays its mines on the first reveal:
    two episodes interleaved see what each sees alone (and what the library shows when driven alone), and the
    caller's own draws do not move."""
    moves = ["[up]", "[left]", "[down]", "[right]"] * 5

    def alone(game, seed, actions):
        env = TextArenaEnv(max_turns=50, game=game)
        out = [env.reset({"seed": seed})[0][-1]["content"]]
        for a in actions:
            msgs, _, term, _, _ = env.step(a)
            out.append(msgs[0]["content"])
            if term:
                break
        return out

    a_ref, b_ref = alone("2048-v0", 11, moves), alone("Minesweeper-v0-small", 5, ["[2 2]", "[0 0]", "[4 4]"])
    random.seed(99)
    expect = [random.random() for _ in range(3)]
    random.seed(99)
    got = [random.random()]
    ea, eb = TextArenaEnv(max_turns=50, game="2048-v0"), TextArenaEnv(max_turns=50, game="Minesweeper-v0-small")
    a_out, b_out = [ea.reset({"seed": 11})[0][-1]["content"]], [eb.reset({"seed": 5})[0][-1]["content"]]
    got.append(random.random())
    for i, a in enumerate(moves):
        a_out.append(ea.step(a)[0][0]["content"])
        if i < 3:
            b_out.append(eb.step(["[2 2]", "[0 0]", "[4 4]"][i])[0][0]["content"])
    got.append(random.random())
    assert got == expect
    assert a_out == a_ref[:len(a_out)] and b_out == b_ref[:len(b_out)]
    lib = ta.make("2048-v0")
    lib.reset(num_players=1, seed=11)
    base = lib.env.env  # under LLMObservationWrapper and ActionFormattingWrapper
    for a in moves[:3]:
        base.get_observation()
        lib.step(a)
    board = [m for _, m, kind in base.get_observation()[1] if kind == ta.ObservationType.GAME_BOARD][-1]
    assert board.strip() in a_out[3]


@pytest.mark.parametrize("text", ["", " ", "[", "]" * 1000, "[" + "9" * 5000 + "]", "[\ud800]", "\x00[5]\x00",
                                  "[5" * 20000, "[-3]", "[1e9]", "\u202e[7]", "[A A]", "[Z Q]"],
                         ids=lambda t: ascii(t[:10]) + (f"..{len(t)}" if len(t) > 10 else ""))
@pytest.mark.parametrize("game", ["GuessTheNumber-v0", "TowerOfHanoi-v0", "Minesweeper-v0-small", "2048-v0"])
def test_hostile_text_never_raises(game, text):
    env = TextArenaEnv(max_turns=3, game=game)
    env.reset({"seed": 1})
    for _ in range(3):
        msgs, reward, term, trunc, info = env.step(text)
        assert isinstance(msgs, list) and math.isfinite(reward) and isinstance(info, dict)
        if term or trunc:
            break
    assert term or trunc


def test_tasks_deterministic_and_splits_disjoint():
    a, b = TextArenaEnv.tasks("train", 50, 3, game="2048-v0"), TextArenaEnv.tasks("train", 50, 3, game="2048-v0")
    assert a == b and len({t["seed"] for t in a}) == 50 and a != TextArenaEnv.tasks("train", 50, 4)
    held = TextArenaEnv.tasks("eval", 100, 4, game="2048-v0")
    assert not {t["seed"] for t in a} & {t["seed"] for t in held}
    assert all(t["id"].startswith("2048-v0-s") for t in a)
    with pytest.raises(ValueError, match="split"):
        TextArenaEnv.tasks("test", 3, 0)
    env = TextArenaEnv(game="Minesweeper-v0-small")
    first = env.reset(a[0])[0][-1]["content"], env.step("[2 2]")[0][0]["content"]
    assert (env.reset(a[0])[0][-1]["content"], env.step("[2 2]")[0][0]["content"]) == first


def test_refusals_are_one_line():
    cases = {"TicTacToe-v0": "one-player", "Nope-v0": "not a TextArena id", "GuessWho-v0": "OpenRouter",
             "Chess-v0": "SyntaxError"}
    for game, why in cases.items():
        with pytest.raises(ValueError, match=why) as e:
            probe(TextArenaConfig(game=game))
        assert "\n" not in str(e.value) and str(e.value).startswith("env.textarena.game: ")
    with pytest.raises(ValueError, match=r"game_kwargs: GuessTheNumberEnv takes min_number, max_number, max_turns; "
                                         r"unknown: max_num$"):
        probe(TextArenaConfig(game="GuessTheNumber-v0", game_kwargs={"max_num": 3}))
    probe(TextArenaConfig(game="Minesweeper-v0-small"))  # offline and single-player: accepted


def test_game_that_downloads_nltk_data_is_refused_offline():
    if not nltk_missing("Wordle-v0"):
        pytest.skip("the NLTK data Wordle loads is installed here")
    assert nltk_missing("SpellingBee-v0") == ["words"]  # through the library's word-list helper
    assert nltk_missing("Minesweeper-v0") == [] and nltk_missing("2048-v0") == []
    with pytest.raises(ValueError, match=r"Wordle-v0 loads NLTK data that is not installed \(.*words\).*offline") as e:
        TextArenaConfig(game="Wordle-v0").validate("env.textarena")
    assert "\n" not in str(e.value) and "nltk.downloader" in str(e.value)


def test_long_horizon_profile_validates():
    from esopt_mp.config import build_config
    from tests.fixtures.configs import compose_config

    cfg = build_config(compose_config("+experiment=textarena_long_tiny"), 1)
    section = cfg.env.sections["textarena"]
    assert (cfg.env.name, section.game, cfg.env.max_turns, section.error_allowance) == ("textarena",
                                                                                        "2048-v0-mega-easy", 24, 24)
    env = TextArenaEnv(max_turns=cfg.env.max_turns, game=section.game, error_allowance=section.error_allowance)
    env.reset(TextArenaEnv.tasks("train", 1, cfg.env.task_seed, game=section.game)[0])
    ends = [env.step("set 1 2 3")[2:4] for _ in range(cfg.env.max_turns)]  # a reply the game cannot read
    assert ends[-1] == (False, True) and not any(any(e) for e in ends[:-1])  # forgiven: all its turns are played


def test_partial_credit_is_in_the_config_hash_only_when_off():
    from esopt_mp.config import build_config
    from esopt_mp.identity import config_hash

    def h(**section):
        return config_hash(build_config({"objective": {"name": "agent"},
                                         "env": {"name": "textarena", "textarena": section}}), None)

    base = h()
    assert h(partial_credit=True) == base  # the default: runs from before the field keep their hash
    assert h(partial_credit=False) != base
