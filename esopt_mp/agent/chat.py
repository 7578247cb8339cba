"""The chat format's former home: it is :mod:`esopt_mp.chat.format`. Kept so that old imports go on working."""
from esopt_mp.chat.format import CHAT_TEMPLATE, GEN_PROMPT, IM_END, IM_START, delta_text, opening_text, render_message  # noqa: F401
