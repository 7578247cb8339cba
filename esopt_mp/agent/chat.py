"""The chat format's former home: it is :mod:`esopt_mp.chat.format`. Kept one release so that old imports go on
working, with a one-line notice."""
import warnings

from esopt_mp.chat.format import CHAT_TEMPLATE, GEN_PROMPT, IM_END, IM_START, delta_text, opening_text, render_message  # noqa: F401

warnings.warn("esopt_mp.agent.chat is now esopt_mp.chat.format: import it from there (the old name goes in the "
              "next release)", DeprecationWarning, stacklevel=2)
