"""The endpoint's rendering (the agent loop's ChatML plus Qwen3's tools block and tool-call history), the reply
parser (content, tool calls, finish reason), and the session matching that decides what a turn re-renders."""
import json

import pytest

from esopt_mp.chat.format import delta_text, opening_text
from esopt_mp.endpoint.render import (call_text, continuation_text, parse_reply, prompt_text, system_with_tools,
                                      tools_block)
from esopt_mp.endpoint.sessions import Sessions, normalise
from esopt_mp.es.seeds import stream_seed

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]


def test_plain_messages_render_as_the_agent_loop_does():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                                                    {"type": "text", "text": "there"}]}]
    assert prompt_text(msgs, None) == opening_text([msgs[0], {"role": "user", "content": "hi there"}])
    tool = [{"role": "tool", "content": "3", "tool_call_id": "x"}]
    assert continuation_text(True, tool) == delta_text(True, [{"role": "tool", "content": "3"}])
    assert continuation_text(False, tool).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n3\n")
    assert prompt_text([{"role": "developer", "content": "d"}], None).startswith("<|im_start|>system\nd<|im_end|>")


def test_tools_block_is_qwen3s_and_joins_the_first_system_message():
    block = tools_block(TOOLS)
    assert block.startswith("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
    assert "\n" + json.dumps(TOOLS[0]) + "\n</tools>\n\n" in block
    assert block.endswith('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    with_sys = system_with_tools([{"role": "system", "content": "S"}, {"role": "user", "content": "u"}], TOOLS)
    assert with_sys[0]["content"] == "S\n\n" + block and len(with_sys) == 2
    without = system_with_tools([{"role": "user", "content": "u"}], TOOLS)
    assert without[0] == {"role": "system", "content": block} and without[1]["content"] == "u"
    assert system_with_tools([{"role": "user", "content": "u"}], None) == [{"role": "user", "content": "u"}]
    assert prompt_text([{"role": "user", "content": "u"}], TOOLS) == opening_text(without)


def test_assistant_tool_calls_in_history_render_as_qwen3s_template():
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    assert call_text(call) == '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    obj = {"function": {"name": "add", "arguments": {"a": 2}}}
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "ok", "tool_calls": [call, obj]}]
    text = prompt_text(msgs, None)
    assert ("<|im_start|>assistant\nok\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>\n"
            "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2}}\n</tool_call><|im_end|>\n") in text
    none = prompt_text([{"role": "assistant", "content": None, "tool_calls": [call]}], None)
    assert none.startswith("<|im_start|>assistant\n<tool_call>\n")  # no newline before the first call


def test_parse_reply_reads_calls_only_with_tools_and_keeps_malformed_ones_as_text():
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    content, calls, finish = parse_reply("thinking\n" + good, "hermes", TOOLS)
    assert content == "thinking" and finish == "tool_calls" and len(calls) == 1
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 1}'} and calls[0]["type"] == "function"
    assert parse_reply(good, "hermes", None) == (good, [], "stop")  # no tools offered: text
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_reply(bad + good, "hermes", TOOLS)[0] == bad  # the malformed block stays in the content
    assert parse_reply(bad, "hermes", TOOLS) == (bad, [], "stop")
    assert parse_reply("cut off", "hermes", TOOLS, finish="length") == ("cut off", [], "length")
    xml = "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
    content, calls, _ = parse_reply(xml, "qwen_xml", TOOLS, id_prefix="call_7_")
    assert content is None and calls[0]["id"] == "call_7_0" and json.loads(calls[0]["function"]["arguments"]) == \
        {"a": "1"}


def test_normalisation_ignores_ids_types_and_none_versus_empty():
    a = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "add", "arguments": '{"b": 2, "a": 1}'}}]}
    b = {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    assert normalise(a) == normalise(b)
    tool = {"role": "tool", "content": "1"}
    assert normalise({**tool, "tool_call_id": "x"}) == normalise(tool)
    assert normalise({"role": "user", "content": "a"}) != normalise({"role": "user", "content": "b"})


def _reply(s: Sessions, t, msgs, text):
    reply = {"role": "assistant", "content": text}
    s.record(t, msgs, reply, True)
    return msgs + [reply]


def test_sessions_continue_the_longest_matching_history_and_seed_new_ones_by_ordinal():
    s = Sessions(99)
    m1 = [{"role": "user", "content": "q"}]
    t0, new, fresh = s.assign(None, m1, None)
    assert fresh and t0.seed == 99 and new == m1
    hist = _reply(s, t0, m1, "a1")
    follow = hist + [{"role": "tool", "content": "r"}]
    t, new, fresh = s.assign(None, follow, None)
    assert t is t0 and not fresh and new == [{"role": "tool", "content": "r"}]
    again, _, fresh = s.assign(None, follow, None)  # the same history while t0 is busy: a conversation of its own
    assert fresh and again.ordinal == 1 and again.seed == stream_seed(99, "conversation", 1)
    hist2 = _reply(s, t0, follow, "a2")
    branch = hist + [{"role": "user", "content": "other"}]  # t0 moved on: no prefix of this any more
    assert s.assign(None, branch, None)[2]
    edited = hist2[:-1] + [{"role": "assistant", "content": "not what was said"}, {"role": "user", "content": "x"}]
    assert s.assign(None, edited, None)[2]  # an assistant message after the match: re-encoded
    assert s.assign("other-session", hist2 + [{"role": "user", "content": "y"}], None)[2]
    assert s.assign(None, hist2 + [{"role": "user", "content": "y"}], TOOLS)[2]  # other tools: other prompt
    t, new, fresh = s.assign(None, hist2 + [{"role": "user", "content": "y"}], None)
    assert t is t0 and not fresh and len(new) == 1


@pytest.mark.parametrize("bad", ["", "2", "a-b"])
def test_config_refuses_bad_values_in_one_line(bad):
    from esopt_mp.config import build_config
    from esopt_mp.typed import ConfigError

    key, value = {"": ("host", " "), "2": ("port", 70000), "a-b": ("api_key_env", "a-b")}[bad]
    with pytest.raises(ConfigError, match=f"endpoint.{key}"):
        build_config({"endpoint": {key: value}})
    with pytest.raises(ConfigError, match="endpoint.tool_parser"):
        build_config({"endpoint": {"tool_parser": "nope"}})


def test_endpoint_settings_stay_out_of_the_config_hash(monkeypatch):
    from esopt_mp.config import build_config
    from esopt_mp.endpoint.config import EndpointConfig, EndpointError
    from esopt_mp.identity import config_hash

    assert config_hash(build_config({})) == config_hash(build_config({"endpoint": {"port": 8000,
                                                                                   "batch_window_s": 0.1}}))
    monkeypatch.delenv("ESOPT_TEST_KEY", raising=False)
    with pytest.raises(EndpointError, match="endpoint.api_key_env=ESOPT_TEST_KEY: the environment variable"):
        EndpointConfig(api_key_env="ESOPT_TEST_KEY").api_key()
    monkeypatch.setenv("ESOPT_TEST_KEY", "k")
    assert EndpointConfig(api_key_env="ESOPT_TEST_KEY").api_key() == "k"
