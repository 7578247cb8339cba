"""The model's reply -> one BrowserGym high-level action string, checked with ``ast`` (never executed here).

BrowserGym runs the action string as Python in the browser process's
interpreter, so only a call to a known action with literal arguments of the
right kinds passes; it is re-rendered from the parsed values, never copied.
The last action in the reply counts (models reason first, act last).
"""
from __future__ import annotations

import ast
import math
import re
import urllib.parse

from esopt_mp.chat.toolcalls import clean_value

# name -> (kinds of the required positional arguments, kinds of optional ones); "s" str, "n" number, "i" int,
# "l" str or list of str
SIGNATURES: dict[str, tuple[str, str]] = {
    "click": ("s", "s"),  # bid, button
    "fill": ("ss", ""),  # bid, value
    "select_option": ("sl", ""),  # bid, option(s)
    "hover": ("s", ""),
    "press": ("ss", ""),  # bid, key combination
    "scroll": ("nn", ""),  # delta_x, delta_y
    "goto": ("s", ""),
    "go_back": ("", ""),
    "go_forward": ("", ""),
    "new_tab": ("", ""),
    "tab_focus": ("i", ""),
    "send_msg_to_user": ("s", ""),
    "report_infeasible": ("s", ""),
}
ACTIONS = tuple(SIGNATURES)
USAGE = ('click("12") | fill("12", "text") | select_option("12", "option") | hover("12") | press("12", "Enter") | '
         'scroll(0, 300) | goto("http://...") | go_back() | go_forward() | new_tab() | tab_focus(0) | '
         'send_msg_to_user("answer") | report_infeasible("reason")')
_CALL = re.compile(r"\b(" + "|".join(ACTIONS) + r")\s*\(")
_TAIL = 4000  # characters of the reply searched for the action
_BIDS = {"click", "fill", "select_option", "hover", "press"}
_MAX_FLOAT = 1.7976931348623157e308  # a larger int cannot become a float (OverflowError)


class ActionError(ValueError):
    """The reply holds no valid action; the message is the feedback the model sees."""


def _kind_ok(kind: str, v) -> bool:
    if kind == "s":
        return isinstance(v, str)
    if kind == "i":
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == "n":  # finite as a float: BrowserGym's scroll passes it to the page's JavaScript
        return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= _MAX_FLOAT and math.isfinite(v)
    return isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(x, str) for x in v))


def _parse_call(src: str) -> str:
    """A canonical action string from one call expression; ActionError says what is wrong with it."""
    node = ast.parse(src.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ActionError(f"not an action call: {src.strip()[:80]}")
    name = node.func.id
    if node.keywords:
        raise ActionError(f"{name}: pass arguments by position, without names")
    try:
        args = [clean_value(ast.literal_eval(a)) for a in node.args]  # a \\ud800 escape reaches the page
    except ValueError:
        raise ActionError(f"{name}: arguments must be literal strings or numbers") from None
    need, opt = SIGNATURES[name]
    if not len(need) <= len(args) <= len(need) + len(opt):
        raise ActionError(f"{name} takes {len(need)}{'-' + str(len(need) + len(opt)) if opt else ''} "
                          f"arguments, got {len(args)}")
    for i, (kind, v) in enumerate(zip(need + opt, args)):
        if name in _BIDS and i == 0 and isinstance(v, int) and not isinstance(v, bool):
            v = args[0] = str(v)  # click(12): element ids are strings in BrowserGym
        if not _kind_ok(kind, v):
            want = {"s": "a string", "i": "an integer", "n": "a finite number",
                    "l": "a string or list of strings"}[kind]
            raise ActionError(f"{name}: argument {i + 1} must be {want}, got {v!r}")
    if name == "goto":  # web pages only: no file://, javascript:, chrome:// ...
        url = urllib.parse.urlsplit(args[0].strip())
        if url.scheme.lower() not in ("http", "https") or not url.netloc:
            raise ActionError(f"goto: the URL must start with http:// or https://, got {args[0][:80]!r}")
    return f"{name}({', '.join(repr(a) for a in args)})"


def parse_action(reply: str) -> str:
    """The last well-formed action call in ``reply`` as BrowserGym action text; else :class:`ActionError`."""
    text = re.sub(r"<think>.*?</think>", "", reply, flags=re.DOTALL)[-_TAIL:]  # bounded parse work
    starts = [m.start() for m in _CALL.finditer(text)]
    last_error = None
    for s in reversed(starts):
        # the shortest prefix from s that parses as one expression: the call's closing parenthesis
        for end in (m.end() for m in re.finditer(r"\)", text[s:])):
            try:
                return _parse_call(text[s:s + end])
            except (SyntaxError, RecursionError, MemoryError):  # not one expression yet, or nested past any use
                continue
            except ActionError as e:
                last_error = e
                break
        if last_error is not None:
            break
    if last_error is not None:
        raise ActionError(f"invalid action: {last_error}. Actions: {USAGE}")
    raise ActionError(f"no action found in the reply. End the reply with exactly one action, one of: {USAGE}")
