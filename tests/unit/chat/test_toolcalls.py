"""The one tool-call parser (the agent loop, the environments and the endpoint read replies with it)."""
import pytest

from esopt_mp.chat.toolcalls import MAX_DEPTH, AnyParser, HermesJSONParser, QwenXMLParser, blocks, build_parser


def test_qwen_xml_and_hermes_json_calls_are_read():
    xml = "<tool_call>\n<function=python>\n<parameter=code>\nprint(1)\n</parameter>\n</function>\n</tool_call>"
    (call,) = QwenXMLParser().parse(xml)
    assert (call.name, call.arguments, call.error) == ("python", {"code": "print(1)"}, None)
    js = '<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}</tool_call>'
    (call,) = HermesJSONParser().parse(js)
    assert (call.name, call.arguments) == ("bash", {"command": "ls"})  # arguments given as a JSON text
    assert AnyParser().parse(xml)[0].name == "python" and AnyParser().parse(js)[0].name == "bash"
    assert AnyParser().parse("no call here") == []


@pytest.mark.parametrize("bad, why", [
    ('<tool_call>{"name": 5, "arguments": {}}</tool_call>', "'name' must be a string"),
    ('<tool_call>{"name": "x", "arguments": [1]}</tool_call>', "'arguments' an object"),
    ('<tool_call>{"name": "x", "arguments": {"a": ' + "[" * (MAX_DEPTH + 2) + "]" * (MAX_DEPTH + 2) + "}}</tool_call>",
     "nested too deeply"),
    ('<tool_call>{"name": "x", "arguments": {</tool_call>', "malformed JSON"),
])
def test_a_malformed_json_call_is_a_call_with_an_error_not_an_exception(bad, why):
    (call,) = HermesJSONParser().parse(bad)
    assert call.name == "" and call.arguments == {} and why in call.error


def test_blocks_give_each_call_with_its_span_an_unclosed_last_one_to_the_end():
    text = "a <tool_call>one</tool_call> b <tool_call>two"
    got = list(blocks(text))
    assert [b for _, b in got] == ["<tool_call>one</tool_call>", "<tool_call>two"]
    assert all(text[s:e] == b for (s, e), b in got)


def test_build_parser_names_and_refusal():
    assert build_parser().name == "any" and build_parser("hermes").name == "hermes"
    with pytest.raises(ValueError, match=r"unknown tool-call parser 'nope'; known: \['any', 'hermes', 'qwen_xml'\]"):
        build_parser("nope")
