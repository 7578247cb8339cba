"""Same member, same text: a 3-turn conversation with tools played through the endpoint by a scripted client (the
official ``openai`` client) is, token for token, the one the in-process agent loop plays with the same seed on an
environment whose system prompt is ``system_with_tools``' text and whose tool results come back as role "tool".

On the shipped tiny agent (greedy) and on a fake engine whose first reply is a tool call (so the echoed
``tool_calls`` of the history are matched back onto the member's own tokens)."""
import threading

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from esopt_mp.agent.loop import AgentConfig, run_episodes
from esopt_mp.endpoint.config import EndpointConfig
from esopt_mp.endpoint.server import EndpointServer
from esopt_mp.engine.hf import HFEngine
from esopt_mp.engine.base import SamplingParams
from tests.unit.endpoint.test_endpoint_server import AGENT, FakeEngine
from tools.bench_endpoint import ScriptedToolEnv, play_client, question


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(AGENT)


@pytest.fixture(scope="module")
def server(tok):
    with EndpointServer(EndpointConfig(batch_window_s=0.2), tok) as s:
        yield s


def through_endpoint(server, engine, task, seed, sampling):
    import openai

    out = {}
    with server.member("member-3-17", [seed], sampling) as m:
        client = openai.OpenAI(base_url=m.routes[0].base_url, api_key="none", max_retries=0)
        th = threading.Thread(target=lambda: out.update(msgs=play_client("", "member-3-17", task, 3, client)[0]))
        th.start()
        m.serve(engine, live=lambda: int(th.is_alive()), until=lambda: not th.is_alive())
        th.join()
        threads = m.routes[0].sessions.threads
        return out["msgs"], [list(t.conv.ids) for t in threads], m.routes[0].records


@pytest.mark.parametrize("which", ["tiny_agent", "fake_tool_calls"])
def test_a_conversation_through_the_endpoint_is_the_agent_loops_token_for_token(which, tok, server):
    if which == "tiny_agent":
        engine = HFEngine(AutoModelForCausalLM.from_pretrained(AGENT).eval(), tok)
        sampling = SamplingParams(temperature=0, presence_penalty=0.0, max_new_tokens=12)
        task = {"question": question(1)}
    else:
        engine = FakeEngine(tok)
        sampling, task = SamplingParams(temperature=0, max_new_tokens=64), {"question": question(1) + " CALL"}
    msgs, convs, records = through_endpoint(server, engine, task, 1234, sampling)
    eps = run_episodes(engine, [ScriptedToolEnv(3)], [task], [1234], AgentConfig(max_turns=3, sampling=sampling))
    assert eps[0].ended == "terminated" and len(eps[0].turns) == 3
    assert len(convs) == 1 and [r["continued"] for r in records] == [False, True, True]  # one conversation
    assert convs[0] == eps[0].token_ids
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    if which == "fake_tool_calls":
        assert msgs[2]["tool_calls"][0]["function"]["name"] == "add" and records[0]["finish"] == "tool_calls"
