"""Hostile model output through every built-in environment's ``step``: no reply may make an environment raise.

A reply is untrusted text. Each environment turns anything it cannot use into feedback (and a failure score where
it evaluates the reply), so the only exceptions left are the infrastructure's. The corpus is fixed (each case names
a way text has broken a parser: deep nesting, huge numbers, lone surrogates, unclosed blocks, wrong JSON types) and
a seeded random part mixes the corpus's fragments.
"""
import random

import pytest

from esopt_mp.envs import make
from esopt_mp.envs.toolcalls import build_parser
from esopt_mp.envs.web.actions import ActionError, parse_action

DEEP = "[" * 3000
HOSTILE = [
    "", " \n\t", "\x00" * 64, "\ud800 lone surrogate \udfff", "x" * 60000,
    '<tool_call>{"name":"python","arguments":{"code":' + DEEP,  # RecursionError in json.loads
    '<tool_call>{"name":"python","arguments":' + DEEP + "]" * 3000 + "}</tool_call>",
    '<tool_call>{"name":"python","arguments":"' + DEEP + '"}</tool_call>',  # arguments as a JSON text
    '<tool_call>{"name": 5, "arguments": {"code": 7, "command": ["ls"]}}</tool_call>',
    '<tool_call>{"name":"python","arguments":[1, 2]}</tool_call>',
    '<tool_call>{"name":"bash","arguments":{"command": null, "cmd": 3}}</tool_call>',
    '<tool_call>{"name":"python","arguments":{"code":"print(\\ud800)"}}</tool_call>',
    '<tool_call>{"name":"python","arguments":{"code": 1e999}}</tool_call>',
    '<tool_call>{"name": "python", "arguments": {"code": "' + "9" * 5000 + '"}}</tool_call>',
    "<tool_call>" * 500,
    "<tool_call>\n<function=python>\n<parameter=code>\n" + "(" * 3000,
    "<tool_call><function=bash><parameter=command>" + "<parameter=x>" * 300,
    "<tool_call><function=" + "a" * 5000 + ">",
    "set 1 1 " + "9" * 5000, "set " + "1" * 5000 + " 1 1", "set -0 -0 -0", "SET 1 1 1 set 99 99 99",
    "\\boxed{" * 1000, "\\boxed{" + "{" * 5000 + "}", "\\boxed{" + "9" * 5000 + "}", "\\boxed{\ud800}",
    "Final answer: " + "a" * 20000, "Final answer: \ud800", "Final answer:" * 1000,
    "scroll(0, " + "9" * 400 + ")", "scroll(" + "9" * 5000 + ", 0)", "scroll(0, -" + "9" * 400 + ".5)",
    "click(" + DEEP + ")", "click(" + "(" * 3000 + ")", 'fill("1", ' + "'a' + " * 2000 + "'b')",
    "tab_focus(" + "9" * 400 + ")", 'goto("http://' + "a" * 5000 + '")', "select_option('1', [" + DEEP + "])",
    "```python\n" + "(" * 3000 + "\n```", "```python\ndef score(item, bins):\n    return " + DEEP + "\n```",
    "```python\n\ud800\n```", "```" * 1000, "```python\n" + "x" * 60000,
    "<think>" * 1000 + "click('1')", "</think>" * 1000,
    'send_msg_to_user("\\ud800")', 'fill("1", "\\udfff")',  # escapes that make lone surrogates in a literal
]
for depth in (17, 600, 980):  # parsed by json, but too deep to copy or log (asdict, json.dumps recurse)
    HOSTILE.append('<tool_call>{"name":"python","arguments":{"code":"print(1)","command":"ls","x":'
                   + "[" * depth + "]" * depth + "}}</tool_call>")


def _mixed(n: int, seed: int = 0) -> list[str]:
    """Replies stitched from pieces of the corpus (seeded): parsers also meet combinations."""
    rng = random.Random(seed)
    pieces = [h[:rng.randint(1, 200)] for h in HOSTILE if h]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(2, 6))) for _ in range(n)]


CORPUS = HOSTILE + _mixed(40)


def _check_step(env, reply):
    """One step: feedback the tokenizer can encode, an info the trajectory file can hold."""
    import json

    msgs, reward, term, trunc, info = env.step(reply)
    assert isinstance(msgs, list) and all(isinstance(m.get("content", ""), str) for m in msgs)
    for m in msgs:
        m.get("content", "").encode("utf-8")
    json.dumps(info, default=str)
    assert isinstance(float(reward), float) and isinstance(term, bool) and isinstance(trunc, bool)
    return reward, term


@pytest.mark.parametrize("name", ["qwen_xml", "hermes", "any"])
def test_parsers_never_raise_and_return_text_arguments(name):
    parser = build_parser(name)
    for reply in CORPUS:
        for call in parser.parse(reply):
            assert isinstance(call.name, str) and isinstance(call.arguments, dict)
            for v in call.arguments.values():  # strings the sandbox can encode, or the call carries an error
                if isinstance(v, str):
                    v.encode("utf-8")


def test_web_actions_are_parsed_or_refused_with_feedback():
    for reply in CORPUS:
        try:
            action = parse_action(reply)
        except ActionError as e:
            assert str(e)
        else:
            assert isinstance(action, str)
    with pytest.raises(ActionError, match="finite number"):
        parse_action("scroll(0, " + "9" * 400 + ")")


def test_sudoku_steps_on_hostile_text():
    from esopt_mp.envs.sudoku import generate

    env = make("sudoku", max_turns=10 ** 6)
    env.reset(generate(1, 5, seed=3)[0])
    for reply in CORPUS:
        reward, term = _check_step(env, reply)
        assert not term


class _Worker:  # the browser thread, here the caller's own
    def call(self, fn, *args, timeout_s=None, **kwargs):
        return fn(*args, **kwargs)


class _Gym:  # BrowserGym's env after reset: every valid action lands on the same page
    def __init__(self):
        self.actions = []

    def step(self, action):
        self.actions.append(action)
        return {"url": "http://127.0.0.1/", "last_action_error": ""}, 0.0, False, False, {}

    def close(self):
        pass


def test_webarena_lite_steps_on_hostile_text(monkeypatch):
    from esopt_mp.envs.web.env import WebArenaLiteEnv

    monkeypatch.setattr(WebArenaLiteEnv, "_tree", lambda self, obs: "[1] button 'ok'")
    env = make("webarena_lite", max_turns=10 ** 6)
    gym = _Gym()
    env.task, env.turn, env.t0, env.goal = {"id": "t", "gym_id": "browsergym/esopt_demo.x"}, 0, 1e18, "goal"
    env.obs, env.gym, env._worker = {"url": "http://127.0.0.1/"}, gym, _Worker()
    for reply in CORPUS:
        _check_step(env, reply)
        assert env.gym is gym  # feedback, not a closed browser
    assert all(isinstance(a, str) for a in gym.actions)
    for a in gym.actions:
        a.encode("utf-8")  # BrowserGym echoes a message into the next page: it must be text the tokenizer takes
    env.gym = env._worker = None


class _HangingWorker(_Worker):  # the browser call never returns within its time limit
    def call(self, fn, *args, timeout_s=None, **kwargs):
        from esopt_mp.envs.web import worker

        if getattr(fn, "__name__", "") == "step":
            raise worker.CallTimeout("no answer")
        return fn(*args, **kwargs)

    def kill(self):
        return 0


@pytest.mark.parametrize("site_up", [True, False])
def test_a_hanging_action_is_the_models_unless_a_site_is_down(monkeypatch, site_up):
    """goto() to an address that accepts and never replies hangs the step: with the task's site answering that is
    the model's doing (TimeoutError: scored 0); with the site down it is the infrastructure's (SiteDown)."""
    import http.server
    import socket
    import threading

    from esopt_mp.envs import InfraError
    from esopt_mp.envs.web.config import WebConfig
    from esopt_mp.envs.web.env import SiteDown, WebArenaLiteEnv

    if site_up:
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{srv.server_address[1]}/"
    else:
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}/"
    monkeypatch.setattr(WebArenaLiteEnv, "_tree", lambda self, obs: "[1] button 'ok'")
    env = make("webarena_lite", max_turns=5, web=WebConfig(preflight_timeout_s=5.0))
    env.task, env.turn, env.t0, env.goal = {"id": "t", "gym_id": "browsergym/esopt_demo.x", "url": url}, 0, 1e18, "g"
    env.obs, env.gym, env._worker = {"url": url}, _Gym(), _HangingWorker()
    try:
        with pytest.raises(TimeoutError if site_up else SiteDown) as e:
            env.step('goto("http://127.0.0.1:9/")')
        assert isinstance(e.value, InfraError) != site_up and env.gym is None
    finally:
        if site_up:
            srv.shutdown()
            srv.server_close()
