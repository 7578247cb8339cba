"""The ``openenv`` adapter against a real OpenEnv server (OpenEnv's own ``create_app`` under uvicorn) on loopback."""
from __future__ import annotations

import socket

import pytest

pytest.importorskip("openenv.core")

from esopt_mp.envs.base import InfraError, call_envs  # noqa: E402
from esopt_mp.envs.libs.openenv import OpenEnvConfig, OpenEnvEnv  # noqa: E402
from esopt_mp.envs.libs.openenv_client import find_json_object  # noqa: E402
from tests.fixtures import openenv_server  # noqa: E402
from tests.fixtures.openenv_game import HIGH, GuessAction, GuessEnvironment, secret  # noqa: E402


@pytest.fixture(scope="module")
def servers():
    """{"game": a server of 8 sessions, "small": one of 1 session (killed by a test)}: started side by side."""
    procs = {}
    try:
        for name, cap in (("game", 8), ("small", 1)):
            procs[name] = openenv_server.spawn(cap)
        urls = {name: openenv_server.wait(p) for name, p in procs.items()}
        yield {**urls, "procs": procs}
    finally:
        for p in procs.values():
            openenv_server.stop(p)


def make(url: str, **kw) -> OpenEnvEnv:
    kw.setdefault("action_field", "guess")
    kw.setdefault("max_turns", 12)
    return OpenEnvEnv(url=url, step_timeout_s=20.0, **kw)


def own_score(seed: int, guesses: list[int]) -> tuple[float, bool]:
    """What the game itself scores for ``guesses`` (summed step rewards, done), played in-process."""
    env = GuessEnvironment()
    env.reset(seed=seed)
    total, done = 0.0, False
    for g in guesses:
        obs = env.step(GuessAction(guess=g))
        total += obs.reward
        done = obs.done
        if done:
            break
    return total, done


def test_scripted_play_scores_what_the_game_scores(servers):
    for seed in (3, 11):
        env = make(servers["game"], action_pattern=r"(\d+)\s*$", max_turns=20)
        msgs, info = env.reset({"id": "t", "seed": seed})
        assert msgs[0]["role"] == "system" and "match the pattern" in msgs[0]["content"]
        assert "Guess it" in msgs[-1]["content"] and info["seed"] == seed
        lo, hi, guesses, rewards, done = 1, HIGH, [], [], False
        while not done:
            g = (lo + hi) // 2
            guesses.append(g)
            out, r, done, trunc, info = env.step(f"Thinking... my guess is {g}")
            rewards.append(r)
            assert info["valid_action"] and not trunc
            if not done:
                lo, hi = (g + 1, hi) if "go higher" in out[0]["content"] else (lo, g - 1)
        assert guesses[-1] == secret(seed)
        total, own_done = own_score(seed, guesses)
        assert own_done and env.returns == "sum"
        assert sum(rewards) == pytest.approx(total, abs=1e-12)  # the same float additions, in the same order
        assert env._client is None  # the session is closed at the episode's end


def test_json_actions_and_replies_without_one(servers):
    env = make(servers["game"], action_format="json")
    msgs, _ = env.reset({"id": "t", "seed": 5})
    assert '"guess"' in msgs[0]["content"]  # the Action's fields, from the server's /schema
    out, r, done, trunc, info = env.step("no object here")
    assert (r, done, trunc, info["valid_action"]) == (0.0, False, False, False)
    assert "no JSON object" in out[0]["content"]
    out, r, done, _, info = env.step(f'I say {{"x": 1}} then {{"guess": {secret(5)}}}')
    assert (r, done, info["valid_action"]) == (1.0, True, True)
    assert find_json_object('{"a": {"b": 1}} x {"c": 2}') == {"c": 2}
    assert find_json_object('{"a": {"b": 1}}') == {"a": {"b": 1}}
    assert find_json_object("".join(f'{{"n": {i}}} ' for i in range(1000))) == {"n": 999}  # the last of many


def test_refused_action_is_feedback_and_the_session_goes_on(servers):
    env = make(servers["game"], max_turns=3)
    env.reset({"id": "t", "seed": 8})
    out, r, done, trunc, info = env.step("fifty")
    assert (r, done, trunc, info["valid_action"]) == (0.0, False, False, False)
    assert "refused" in out[0]["content"] and "guess" in out[0]["content"] and "integer" in out[0]["content"]
    wrong = 1 if secret(8) != 1 else 2
    out, r, done, trunc, _ = env.step(str(wrong))  # the same session, still playing
    assert (r, done, trunc) == (pytest.approx(-0.1), False, False) and "wrong" in out[0]["content"]
    out, r, done, trunc, info = env.step("still no number")  # the last turn: refused, and cut
    assert (r, done, trunc, info["valid_action"]) == (0.0, False, True, False)
    assert "refused" in out[0]["content"] and "Your whole reply is the action" not in out[0]["content"]
    assert out[0]["content"].endswith("\nOut of turns (3/3): the episode is over.")  # no action asked past it
    assert env._client is None

    strict = make(servers["game"], invalid_action="fail")
    strict.reset({"id": "t", "seed": 8})
    with pytest.raises(ValueError, match="invalid action") as e:
        strict.step("fifty")
    assert not isinstance(e.value, InfraError) and strict._client is None


def test_an_action_the_env_fails_on_is_the_models_failure(servers):
    env = make(servers["game"])
    env.reset({"id": "t", "seed": 2})
    with pytest.raises(RuntimeError, match="failed the action") as e:
        env.step("500")  # the game's step raises on a guess outside 1..100
    assert not isinstance(e.value, InfraError)


def test_a_step_past_its_time_limit_is_the_models_while_the_server_answers(servers):
    url = servers["game"].replace("http://", "ws://") + "/ws"  # the WebSocket spelling of the address works too
    env = OpenEnvEnv(url=url, action_format="json", step_timeout_s=1.0)
    env.reset({"id": "t", "seed": 7})
    with pytest.raises(TimeoutError, match="the action is the model's") as e:
        env.step('{"guess": 50, "wait_s": 3}')
    assert not isinstance(e.value, InfraError) and env._client is None


def test_three_concurrent_sessions_keep_their_own_games(servers):
    seeds = [4, 9, 21]
    envs = [make(servers["game"], max_turns=20) for _ in seeds]
    assert all(e.concurrent for e in envs)
    for (msgs, _), err, _ in call_envs([(e, "reset", {"id": str(s), "seed": s}) for e, s in zip(envs, seeds)]):
        assert err is None and "Guess it" in msgs[-1]["content"]
    bounds = {i: [1, HIGH] for i in range(3)}
    found, steps = {}, {i: [] for i in range(3)}
    while len(found) < 3:
        live = [i for i in range(3) if i not in found]
        guesses = {i: sum(bounds[i]) // 2 for i in live}
        outs = call_envs([(envs[i], "step", str(guesses[i])) for i in live], max_workers=3)
        for i, (res, err, _) in zip(live, outs):
            assert err is None, err
            msgs, r, done, _, _ = res
            steps[i].append(guesses[i])
            if done:
                found[i] = guesses[i]
            elif "go higher" in msgs[0]["content"]:
                bounds[i][0] = guesses[i] + 1
            else:
                bounds[i][1] = guesses[i] - 1
    assert [found[i] for i in range(3)] == [secret(s) for s in seeds]
    for i, s in enumerate(seeds):
        assert own_score(s, steps[i])[1]  # each session's moves win that seed's game played alone


def test_hostile_text_is_feedback_or_the_models_failure(servers):
    hostile = ["", "\ud800", "\x00\x01", "🙂" * 3000, "9" * 5000, "-1", "0", "1e400", "{" * 20000, "[" * 20000,
               '{"guess": ' + "[" * 5000, '{"guess": 1' + "0" * 5000 + "}", '{"guess": 1e400}',
               '{"guess": "\\ud800"}', '{"guess": 3, "metadata": {"\\udfff": [1]}}', '{"guess": 3, "bogus": 1}',
               '{"guess": {"$ref": "#"}}', '{"type": "call_tool", "tool_name": "x"}', "<script>" * 500]
    for fmt in ("text", "json"):
        env = make(servers["game"], action_format=fmt, max_turns=len(hostile) + 1)
        env.reset({"id": "t", "seed": 1})
        for text in hostile:
            try:
                out, r, done, trunc, info = env.step(text)
            except InfraError:
                raise
            except RuntimeError as e:  # the game's own step refused it (a number outside 1..100)
                assert "failed the action" in str(e), (fmt, text[:40], e)
                env.reset({"id": "t", "seed": 1})
                continue
            assert not done and r in (0.0, pytest.approx(-0.1)), (fmt, text[:40])
            if not info["valid_action"]:
                assert out and isinstance(out[0]["content"], str)
                out[0]["content"].encode("utf-8")  # valid text
        env.close()
    assert OpenEnvEnv.check(url=servers["game"]) is None  # the server is still up


def test_at_capacity_a_reset_waits_then_fails_as_infra(servers):
    first = make(servers["small"])
    first.reset({"id": "a", "seed": 1})
    second = make(servers["small"], capacity_wait_s=0.5)
    with pytest.raises(InfraError, match="capacity"):
        second.reset({"id": "b", "seed": 2})
    first.close()  # the server frees its session once it has seen the disconnect
    third = make(servers["small"])  # waits for it (capacity_wait_s=30)
    msgs, _ = third.reset({"id": "b", "seed": 2})  # a freed session is taken
    assert "Guess it" in msgs[-1]["content"]
    second.close()
    third.close()


def test_a_server_killed_mid_episode_is_infra(servers):
    env = make(servers["small"])
    env.reset({"id": "t", "seed": 6})
    proc = servers["procs"]["small"]
    proc.kill()
    proc.wait(timeout=30)
    with pytest.raises(InfraError):
        env.step("50")
    assert env._client is None
    with pytest.raises(InfraError):
        env.reset({"id": "t", "seed": 6})
    with pytest.raises(RuntimeError, match=r"env\.openenv\.url=.*does not answer") as e:
        OpenEnvEnv.check(url=servers["small"], connect_timeout_s=2.0)
    assert "\n" not in str(e.value)


def test_the_startup_check_names_an_unreachable_url_in_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(RuntimeError) as e:
        OpenEnvEnv.check(url=url, connect_timeout_s=2.0)
    msg = str(e.value)
    assert msg.startswith(f"env.openenv.url={url}: the OpenEnv server does not answer") and "\n" not in msg


def test_tasks_are_seeded_and_disjoint():
    train, held = OpenEnvEnv.tasks("train", 50, 0), OpenEnvEnv.tasks("eval", 100, 1)
    assert train == OpenEnvEnv.tasks("train", 50, 0) and len({t["seed"] for t in train}) == 50
    assert not {t["seed"] for t in train} & {t["seed"] for t in OpenEnvEnv.tasks("eval", 100, 0)}
    assert all(t["seed"] % 2 == 1 for t in held)
    with pytest.raises(ValueError, match="split"):
        OpenEnvEnv.tasks("test", 1, 0)


@pytest.mark.parametrize("kw, key", [({"url": ""}, "url"), ({"url": "ftp://x"}, "url"),
                                     ({"url": "http://h:1", "action_format": "xml"}, "action_format"),
                                     ({"url": "http://h:1", "action_pattern": "("}, "action_pattern"),
                                     ({"url": "http://h:1", "returns": "mean"}, "returns"),
                                     ({"url": "http://h:1", "reset_kwargs": {"seed": 1}}, "reset_kwargs"),
                                     ({"url": "http://h:1", "max_concurrent": 0}, "max_concurrent"),
                                     ({"url": "http://h:1", "step_timeout_s": float("nan")}, "step_timeout_s")])
def test_section_validation_names_the_key(kw, key):
    with pytest.raises(ValueError, match=rf"^env\.openenv\.{key}: "):
        OpenEnvConfig(**kw).validate("env.openenv")


def test_the_library_is_imported_at_reset_not_with_the_adapter():
    import subprocess
    import sys

    code = "import sys, esopt_mp.envs.libs.openenv; print('openenv' in sys.modules)"  # the library loads at reset
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False"], out.stderr[-500:]
