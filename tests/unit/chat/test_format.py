"""The chat format: a conversation grown turn by turn by deltas is the text the template renders for the whole of
it, so the prefix-reusing and the re-encoding engine see the same sequence."""
import pytest

from esopt_mp.chat.format import CHAT_TEMPLATE, GEN_PROMPT, IM_END, clean_text, delta_text, opening_text

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
