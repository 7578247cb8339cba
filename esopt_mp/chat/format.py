"""ChatML rendering (Qwen's format), the token deltas of a growing conversation, and a reply as valid text.

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
