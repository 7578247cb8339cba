"""ChatML rendering (Qwen's format), the token deltas of a growing conversation, and a reply as valid text;
a model's own chat template where it is not ChatML (:func:`build_chat_format`).

Turn 1 encodes the opening messages plus the generation prompt. Every later
turn appends only the *delta* after the model's own tokens: the end of the
assistant message (if generation stopped before ``<|im_end|>``), the new
environment messages, and the next generation prompt. The same ids serve the
prefix-reusing and the re-encoding engine, so both see identical sequences.
"""
from __future__ import annotations

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
GEN_PROMPT = f"{IM_START}assistant\n"


def render_message(m: dict) -> str:
    role, content = m["role"], m.get("content") or ""
    if role == "tool":
        return f"{IM_START}user\n<tool_response>\n{content}\n</tool_response>{IM_END}\n"
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def opening_text(messages: list[dict]) -> str:
    return "".join(render_message(m) for m in messages) + GEN_PROMPT


def delta_text(ended_with_im_end: bool, messages: list[dict]) -> str:
    return ("\n" if ended_with_im_end else f"{IM_END}\n") + "".join(render_message(m) for m in messages) + GEN_PROMPT


def clean_text(s: str) -> str:
    """``s`` as valid UTF-8 text: a lone surrogate (a JSON ``\\ud800`` escape) becomes U+FFFD, so whatever runs
    the argument (a sandbox writing it to a pipe) can encode it."""
    return s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")  # a valid pair joins


CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


_REPLY, _NEXT = "\ue000esopt-reply\ue001", "\ue000esopt-next\ue001"  # private-use text: in no real message


class ChatML:
    """ChatML as above: the format of a tokenizer whose template is ChatML (the tiny agent's, SmolLM2's, Qwen's)
    or that has none. A reply ended cleanly when its last token is ``<|im_end|>``."""
    name, stop, end_tokens = "chatml", (), ()

    def __init__(self, tokenizer):
        self.end = tokenizer.convert_tokens_to_ids(IM_END)

    def opening(self, messages: list[dict]) -> str:
        return opening_text(messages)

    def delta(self, history: list[dict], reply_ids: list[int], finish: str, messages: list[dict]) -> str:
        return delta_text(bool(reply_ids) and reply_ids[-1] == self.end, messages)


class ChatFormatError(ValueError):
    """The model's chat template cannot render a conversation (a role it does not take, an order it refuses)."""


class TemplateChat:
    """A model's own chat template (its tokenizer's, such as the plain one a base model's GGUF file is given).

    A turn's delta is what the template writes after the assistant's reply: the conversation is rendered with a
    marker in the reply's place and the text after the marker taken, less what the reply already ends with (its
    end token, or the stop string it stopped at). A reply stops where the template starts the next message
    (``stop``: engines add it to a generation's stop strings), which matters for a template with no end-of-turn
    token, as a base model writes the next turn itself; a special token the template ends a message with
    (``end_tokens``) ends a reply as the tokenizer's EOS does.
    """
    name = "template"

    def __init__(self, tokenizer):
        self.tok = tokenizer
        probe = self._render([{"role": "user", "content": "1"}, {"role": "assistant", "content": _REPLY},
                              {"role": "user", "content": _NEXT}], False)
        between = probe[probe.index(_REPLY) + len(_REPLY):probe.index(_NEXT)].rstrip()
        self.stop = (between,) if between.strip() else ()
        special = sorted(getattr(tokenizer, "all_special_tokens", None) or [], key=len, reverse=True)
        self.end_tokens = tuple(t for t in special if t and between.startswith(t))[:1]

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # noqa: BLE001 - jinja's TemplateError, or what the template raises itself
            roles = ", ".join(str(m.get("role")) for m in messages)
            raise ChatFormatError(f"the model's chat template cannot render this conversation (roles: {roles}): "
                                  f"{type(e).__name__}: {e}") from None

    def opening(self, messages: list[dict]) -> str:
        return self._render(messages, True)

    def delta(self, history: list[dict], reply_ids: list[int], finish: str, messages: list[dict]) -> str:
        text = self._render([*history, {"role": "assistant", "content": _REPLY}, *messages], True)
        after = text[text.index(_REPLY) + len(_REPLY):]
        done = ""
        if finish == "eos" and reply_ids:
            done = self.tok.decode(reply_ids[-1:], skip_special_tokens=False)
        elif finish == "stop" and self.stop and self.tok.decode(reply_ids[-16:]).rstrip().endswith(self.stop[0]):
            done = self.stop[0]  # its own stop string, not another one the sampling was given
        return after[len(done):] if done and after.startswith(done) else after


def build_chat_format(tokenizer) -> ChatML | TemplateChat:
    """The tokenizer's own chat format: ChatML where its template is ChatML or it has none, else its template
    (of several named ones, the ``default``, as transformers renders)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return ChatML(tokenizer) if not template or IM_START in str(template) else TemplateChat(tokenizer)
