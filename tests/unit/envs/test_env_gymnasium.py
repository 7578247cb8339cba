"""The Gymnasium adapter plays toy_text games exactly as the library does: its rewards, ends and randomness."""
import collections
import json
import math

import pytest

gym = pytest.importorskip("gymnasium")

from esopt_mp.envs.libs.gymnasium import ACTIONS, GymnasiumConfig, GymnasiumEnv, parse_action  # noqa: E402


def _plan(env_id: str, seed: int, **kwargs) -> list[int]:
    """Shortest action sequence to the best terminal transition, by BFS over the library's own (deterministic)
    transition table from the state ``reset(seed)`` starts in."""
    env = gym.make(env_id, **kwargs)
    start, _ = env.reset(seed=seed)
    table = env.unwrapped.P
    assert all(len(o) == 1 for a in table.values() for o in a.values()), "the planner needs a deterministic game"
    best = max(o[0][2] for a in table.values() for o in a.values() if o[0][3])
    prev, todo = {int(start): None}, collections.deque([int(start)])
    while todo:
        s = todo.popleft()
        for a, ((_, nxt, r, done),) in table[s].items():
            if done and r == best:
                path = [a]
                while prev[s] is not None:
                    s, a0 = prev[s]
                    path.append(a0)
                return path[::-1]
            if not done and nxt not in prev:
                prev[nxt] = (s, a)
                todo.append(nxt)
    raise AssertionError(f"no path to the goal in {env_id}")


def _library(env_id: str, seed: int, actions: list[int], **kwargs) -> list[tuple]:
    """(obs, reward, terminated, truncated) of each action, the library driven directly."""
    env = gym.make(env_id, **kwargs)
    env.reset(seed=seed)
    out = []
    for a in actions:
        obs, r, term, trunc, _ = env.step(a)
        out.append((obs, float(r), term, trunc))
        if term or trunc:
            break
    return out


def _play(env: GymnasiumEnv, task: dict, replies: list[str]) -> list[tuple]:
    msgs, info = env.reset(task)
    assert msgs[-1]["role"] == "user"
    out = []
    for text in replies:
        msgs, r, term, trunc, info = env.step(text)
        obs = info["obs"]
        out.append((tuple(obs) if isinstance(obs, list) else obs, r, term, trunc))
        if term or trunc:
            break
    return out


@pytest.mark.parametrize("env_id,kwargs", [("FrozenLake-v1", {"is_slippery": False}),
                                           ("FrozenLake-v1", {"is_slippery": False, "map_name": "8x8"}),
                                           ("Taxi-v4", {}), ("CliffWalking-v1", {})])
def test_planned_path_scores_what_the_library_scores(env_id, kwargs):
    seed = GymnasiumEnv.tasks("train", 1, 3, id=env_id)[0]["seed"]
    path = _plan(env_id, seed, **kwargs)
    names = ACTIONS[type(gym.make(env_id, **kwargs).unwrapped).__name__]
    env = GymnasiumEnv(id=env_id, kwargs=kwargs, max_turns=60)
    replies = [f"I will go <action>{names[a].upper()}</action>" for a in path]
    ours = _play(env, {"id": "t", "seed": seed}, replies)
    theirs = _library(env_id, seed, path, **kwargs)
    assert ours == theirs
    assert ours[-1][2] is True and len(ours) == len(path)
    ret = sum(r for _, r, _, _ in ours)
    # the library's optimum, computed from its reward rules: FrozenLake 1 at G; Taxi -1 a move, +20 the delivery;
    # CliffWalking -1 a step
    want = {"FrozenLake-v1": 1.0, "Taxi-v4": 20.0 - (len(path) - 1), "CliffWalking-v1": -float(len(path))}[env_id]
    assert ret == want
    if env_id == "Taxi-v4":
        assert len(path) >= 10  # a long horizon: a dozen turns or more


def test_slippery_frozen_lake_follows_the_library_randomness():
    """Random slides come from the library's own seeded generator: the same seed and actions give the same walk."""
    actions = [1, 2, 1, 2, 1, 2, 1, 2] * 5
    for task in GymnasiumEnv.tasks("train", 4, 0, id="FrozenLake-v1"):
        env = GymnasiumEnv(id="FrozenLake-v1", max_turns=len(actions))
        ours = _play(env, task, [f"<action>{a}</action>" for a in actions])
        assert ours == _library("FrozenLake-v1", task["seed"], actions)


def test_blackjack_scripted_policy_and_words():
    for task in GymnasiumEnv.tasks("eval", 6, 1, id="Blackjack-v1"):
        env = GymnasiumEnv(id="Blackjack-v1", max_turns=10)
        msgs, info = env.reset(task)
        assert f"Your cards sum to {info['obs'][0]}" in msgs[-1]["content"]
        lib = gym.make("Blackjack-v1")
        obs, _ = lib.reset(seed=task["seed"])
        assert list(obs) == info["obs"]
        total, done = 0.0, False
        while not done:
            a = 1 if obs[0] < 17 else 0
            _, r, term, trunc, info = env.step("<action>hit</action>" if a else "<action>stick</action>")
            obs, r_lib, term_lib, trunc_lib, _ = lib.step(a)
            assert (r, term, trunc, info["obs"]) == (float(r_lib), term_lib, trunc_lib, list(obs))
            total += r
            done = term or trunc
        assert total in (-1.0, 0.0, 1.0)


def test_unreadable_reply_is_feedback_and_a_penalty():
    env = GymnasiumEnv(id="Taxi-v4", max_turns=3, invalid_reward=-2.5)
    msgs, info = env.reset({"id": "t", "seed": 4})
    start = info["obs"]
    msgs, r, term, trunc, info = env.step("drive to the passenger please")
    assert (r, term, trunc, info["valid_action"], info["obs"]) == (-2.5, False, False, False, start)
    assert "<action>NAME</action>" in msgs[0]["content"] and "nothing moved" in msgs[0]["content"]
    assert "south (0), north (1)" in env.reset({"id": "t", "seed": 4})[0][0]["content"]  # the actions: system prompt
    env.step("drive to the passenger please")
    env.step("<action>7</action>")  # no such action: out of range
    msgs, r, term, trunc, info = env.step("<action>north</action>")
    assert trunc and not term and msgs  # the run's turn budget truncates
    assert env.step("<action>north</action>")[2] is True  # after the end: nothing moves


def test_library_time_limit_truncates():
    env = GymnasiumEnv(id="FrozenLake-v1", kwargs={"is_slippery": False, "max_episode_steps": 2}, max_turns=10)
    env.reset({"id": "t", "seed": 0})
    assert env.step("<action>right</action>")[3] is False
    msgs, r, term, trunc, _ = env.step("<action>right</action>")
    assert (r, term, trunc) == (0.0, False, True)
    last = msgs[-1]["content"].splitlines()[-1]
    assert last == "FrozenLake-v1's own step limit ended the episode (turn 2/10)." and "Your action" not in last


def test_the_last_turns_message_shows_no_turn_past_the_budget():
    """Every prompt counts turns within the budget; the message after the last turn says the episode is over."""
    env = GymnasiumEnv(id="FrozenLake-v1", kwargs={"is_slippery": False}, max_turns=4)
    msgs, _ = env.reset({"id": "t", "seed": 0})
    shown = [msgs[-1]["content"].splitlines()[-1]]
    for _ in range(4):
        msgs, _, term, trunc, _ = env.step("<action>left</action>")  # into the wall: never ends by itself
        shown.append(msgs[-1]["content"].splitlines()[-1])
    assert (term, trunc) == (False, True)
    assert shown == [f"Turn {t}/4. Your action:" for t in (1, 2, 3, 4)] + ["Out of turns (4/4): the episode is over."]


HOSTILE = ["", " ", "\x00\x00", "\ud800<action>up</action>\udfff", "<action>" * 20000,
           "<action>" + "9" * 5000 + "</action>", "<action>-1</action>", "<action>1e3</action>",
           "<action>\u0663</action>", "<action></action>" * 1000, "<action>left" + "x" * 100000, "</action><action>",
           "{\"action\": 2}", "a" * 300000, "<ACTION> Drop_Off </ACTION>"]


@pytest.mark.parametrize("i", range(len(HOSTILE)))
def test_hostile_text_never_raises(i):
    env = GymnasiumEnv(id="Taxi-v4", max_turns=4)
    env.reset({"id": "t", "seed": 1})
    msgs, r, term, trunc, info = env.step(HOSTILE[i])
    assert math.isfinite(r) and isinstance(msgs, list)
    json.dumps(info)


def test_parse_action():
    names = ACTIONS["TaxiEnv"]
    assert parse_action("<action>west</action> no, <action>Pick Up</action>", names, 6) == 4
    assert parse_action("2", names, 6) == 2
    assert parse_action("dropoff.", names, 6) == 5
    assert parse_action("<action>6</action>", names, 6) is None
    assert parse_action("I go west", names, 6) is None  # a bare word inside prose is not an answer
    assert parse_action("<action>\u0663</action>", names, 6) is None  # ASCII digits only


def test_lenient_reads_the_last_action_named_in_prose_and_a_tag_still_decides():
    names = ACTIONS["BlackjackEnv"]
    assert parse_action("I would hit, then maybe stick.", names, 2, "lenient") == 0
    assert parse_action("Stick? No: HIT!", names, 2, "lenient") == 1
    assert parse_action("sticky hits", names, 2, "lenient") is None  # whole words only
    assert parse_action("hit <action>fold</action>", names, 2, "lenient") is None  # a tag is the answer, even a bad one
    assert parse_action("<action>stick</action> then hit", names, 2, "lenient") == 0
    assert parse_action("stick", names, 2, "lenient") == 0 and parse_action("1", names, 2, "lenient") == 1
    assert parse_action("I would hit", names, 2) is None  # strict stays the default
    assert parse_action("hit " * 50_000, names, 2, "lenient") == 1  # long hostile text: one linear pass


def test_lenient_episode_plays_the_action_and_scores_only_the_game():
    env = GymnasiumEnv(max_turns=3, id="Blackjack-v1", answer_format="lenient")
    env.reset({"id": "b", "seed": 2})
    _, reward, done, _, info = env.step("Hmm, with that dealer card I think I will stick here.")
    assert info["valid_action"] and info["action"] == 0 and done and reward in (-1.0, 0.0, 1.0)
    strict = GymnasiumEnv(max_turns=3, id="Blackjack-v1")
    strict.reset({"id": "b", "seed": 2})
    _, reward, done, _, info = strict.step("Hmm, with that dealer card I think I will stick here.")
    assert not info["valid_action"] and not done and reward == -1.0
    with pytest.raises(ValueError, match="answer_format"):
        GymnasiumConfig(id="Blackjack-v1", answer_format="loose").validate()


def test_tasks_deterministic_and_disjoint():
    a = GymnasiumEnv.tasks("train", 50, 7, id="Taxi-v4")
    assert a == GymnasiumEnv.tasks("train", 50, 7, id="Taxi-v4")
    assert a != GymnasiumEnv.tasks("train", 50, 8, id="Taxi-v4")
    held = GymnasiumEnv.tasks("eval", 50, 8, id="Taxi-v4")
    assert not {t["seed"] for t in a} & {t["seed"] for t in held}
    maps = GymnasiumEnv.tasks("train", 5, 7, id="FrozenLake-v1", random_map_size=6)
    assert maps == GymnasiumEnv.tasks("train", 5, 7, id="FrozenLake-v1", random_map_size=6)
    assert len({tuple(t["desc"]) for t in maps}) > 1 and json.loads(json.dumps(maps)) == maps
    # a random map is the library's, and the planned path on it scores 1
    t = maps[0]
    kwargs = {"is_slippery": False, "desc": t["desc"]}
    path = _plan("FrozenLake-v1", t["seed"], **kwargs)
    env = GymnasiumEnv(id="FrozenLake-v1", kwargs={"is_slippery": False}, random_map_size=6, max_turns=40)
    ours = _play(env, t, [f"<action>{a}</action>" for a in path])
    assert ours == _library("FrozenLake-v1", t["seed"], path, **kwargs) and ours[-1][1] == 1.0
    with pytest.raises(ValueError, match="split"):
        GymnasiumEnv.tasks("test", 1, 0)


@pytest.mark.parametrize("cfg,match", [
    ({"id": "Nope-v0"}, "env.gymnasium.id"), ({"id": "CartPole-v1"}, "no text rendering"),
    ({"id": "Taxi-v4", "random_map_size": 5}, "only FrozenLake"), ({"kwargs": {"render_mode": "human"}}, "render_mode"),
    ({"invalid_reward": math.inf}, "invalid_reward"), ({"random_map_size": 1}, "random_map_size"),
])
def test_validation_is_one_line(cfg, match):
    with pytest.raises(ValueError, match=match) as e:
        GymnasiumConfig(**cfg).validate()
    assert "\n" not in str(e.value)


def test_check_names_a_bad_argument():
    with pytest.raises(ValueError, match="bogus") as e:
        GymnasiumEnv.check(id="FrozenLake-v1", kwargs={"bogus": 1})
    assert "\n" not in str(e.value)
    GymnasiumEnv.check(id="Blackjack-v1")


def test_failure_return_is_the_lowest_return():
    env = GymnasiumEnv(id="Taxi-v4", max_turns=30)
    env.reset({"id": "t", "seed": 0})
    assert env.failure_return == -300.0  # 30 illegal pickups, -10 each
    env = GymnasiumEnv(id="FrozenLake-v1", max_turns=8)
    env.reset({"id": "t", "seed": 0})
    assert env.failure_return == -8.0  # eight unreadable replies
