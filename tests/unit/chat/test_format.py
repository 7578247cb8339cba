"""The chat format: a conversation grown turn by turn by deltas is the text the template renders for the whole of
it, so the prefix-reusing and the re-encoding engine see the same sequence."""
import pytest

from esopt_mp.chat.format import (CHAT_TEMPLATE, GEN_PROMPT, IM_END, ChatFormatError, build_chat_format, clean_text,
                                  delta_text, opening_text)
from esopt_mp.models.gguf import PLAIN_TEMPLATE

jinja2 = pytest.importorskip("jinja2")

OPENING = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def _template(messages, add_generation_prompt=True):
    return jinja2.Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("ended_with_im_end", [True, False])
def test_opening_plus_reply_plus_delta_is_the_templates_text(ended_with_im_end):
    reply = "<tool_call>x</tool_call>"
    then = [{"role": "tool", "content": "4"}, {"role": "user", "content": "and 3+3?"}]
    grown = opening_text(OPENING) + reply + (IM_END if ended_with_im_end else "")
    grown += delta_text(ended_with_im_end, then)
    whole = OPENING + [{"role": "assistant", "content": reply}] + then
    assert grown == _template(whole)
    assert opening_text(OPENING) == _template(OPENING) and grown.endswith(GEN_PROMPT)


def test_clean_text_replaces_lone_surrogates_and_joins_valid_pairs():
    assert clean_text("a\ud800b") == "a\ufffdb"
    assert clean_text("\ud83d\ude00") == "\U0001F600"  # a pair written as two escapes is one character
    assert clean_text("plain") == "plain"
    clean_text("a\ud800b").encode("utf-8")  # encodable: what a sandbox pipe needs


# a model's own template (not ChatML), rendered by transformers: the plain one a base model's GGUF file is given,
# and one whose messages end with an end token (the tiny agent's <|im_end|>, which its tokenizer knows)
ENDED = ("{% for m in messages %}[{{ m.role }}]\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}[assistant]\n{% endif %}")
THEN = [{"role": "user", "content": "and 3+3?"}]


@pytest.fixture
def tok():
    transformers = pytest.importorskip("transformers")
    from esopt_mp.models.tiny import TINY_AGENT

    return transformers.AutoTokenizer.from_pretrained(TINY_AGENT)


def _whole(tok, reply):
    return tok.apply_chat_template(OPENING + [{"role": "assistant", "content": reply}] + THEN, tokenize=False,
                                   add_generation_prompt=True)


def test_a_chatml_template_or_none_keeps_chatml_and_another_is_the_models_own(tok):
    assert build_chat_format(tok).name == "chatml" and "<|im_start|>" in tok.chat_template
    tok.chat_template = None
    assert build_chat_format(tok).name == "chatml"
    tok.chat_template = PLAIN_TEMPLATE
    chat = build_chat_format(tok)
    assert chat.name == "template" and chat.stop == ("\nUser:",)  # where a base model would write the next turn
    assert chat.opening(OPENING) == "System: Be brief.\nUser: 2+2?\nAssistant:"
    tok.chat_template = ENDED
    assert build_chat_format(tok).stop == ("<|im_end|>\n[user]",)


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_plain_template_grown_by_deltas_is_its_text_for_the_whole(tok, finish):
    """A reply cut at the stop string holds it already (its tokens were generated); one cut by length does not."""
    tok.chat_template = PLAIN_TEMPLATE
    chat = build_chat_format(tok)
    generated = " 4" + ("\nUser:" if finish == "stop" else "")
    grown = chat.opening(OPENING) + generated
    grown += chat.delta(OPENING, tok.encode(generated, add_special_tokens=False), finish, THEN)
    assert grown == _whole(tok, "4")  # the template writes "Assistant: " before a message's text
    assert grown.endswith("User: and 3+3?\nAssistant:") and grown.count("User:") == 2


@pytest.mark.parametrize("finish", ["eos", "length"])
def test_a_template_with_an_end_token_grown_by_deltas_is_its_text_for_the_whole(tok, finish):
    tok.chat_template = ENDED
    chat = build_chat_format(tok)
    ids = tok.encode("4", add_special_tokens=False) + ([tok.convert_tokens_to_ids(IM_END)] if finish == "eos" else [])
    grown = chat.opening(OPENING) + tok.decode(ids, skip_special_tokens=False)
    grown += chat.delta(OPENING, ids, finish, THEN)
    assert grown == _whole(tok, "4")


def test_a_template_s_end_token_ends_a_reply_and_another_stop_string_keeps_the_next_header(tok):
    from esopt_mp.engine.base import chat_stops, eos_ids

    tok.chat_template = ENDED  # its messages end with <|im_end|>, a special token (not ChatML: no <|im_start|>)
    chat = build_chat_format(tok)
    assert chat.end_tokens == ("<|im_end|>",) and tok.convert_tokens_to_ids(IM_END) in eos_ids(tok)
    tok.chat_template = PLAIN_TEMPLATE
    chat = build_chat_format(tok)
    assert chat_stops(tok) == ("\nUser:",) and chat.end_tokens == ()
    cut = tok.encode(" 5</a>", add_special_tokens=False)  # a reply cut by a stop string of the run's own
    assert chat.delta(OPENING, cut, "stop", THEN) == "\nUser: and 3+3?\nAssistant:"


def test_a_conversation_the_template_cannot_render_is_one_error_not_a_model_failure(tok):
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}"
                         "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    chat = build_chat_format(tok)
    with pytest.raises(ChatFormatError, match=r"^the model's chat template cannot render this conversation \(roles: "
                                              r"system, user, assistant, tool\): .*no tool role"):
        chat.delta(OPENING, [], "length", [{"role": "tool", "content": "4"}])


def test_named_templates_use_the_default_one(tok):
    tok.chat_template = {"default": PLAIN_TEMPLATE, "tool_use": CHAT_TEMPLATE}
    assert build_chat_format(tok).name == "template"
