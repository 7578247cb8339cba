"""BrowserGym observation -> the text the model reads, within a token budget.

Always shown: the goal, the URL and open tabs, the latest feedback (the newest
chat message and this environment's own parse feedback) and the last action's
error, each capped to a share of the budget (:data:`SHARES`; the goal whole up
to its share, the others cut with a marker saying how much). The accessibility
tree fills the rest: whole if it fits, else a window of lines around the
focused element (or from the top when nothing has focus), with markers saying
how many lines were cut. The whole text stays within the budget. Tokens are
estimated at ``CHARS_PER_TOKEN`` characters each: envs do not load the model's
tokenizer.
"""
from __future__ import annotations

import re

CHARS_PER_TOKEN = 4
SHARES = {"goal": 1 / 4, "page": 1 / 8, "message": 1 / 8, "feedback": 1 / 8, "error": 1 / 8}  # of the budget


def estimate_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


def _focused_line(lines: list[str], bid: str | None) -> int | None:
    if not bid:
        return None
    tag = re.compile(rf"^\s*\[{re.escape(bid)}\](\s|$)")  # the line's own element id, not a "[15]" in its text
    for i, line in enumerate(lines):
        if tag.match(line):
            return i
    return None


def cap(text: str, chars: int) -> str:
    """``text`` whole if it has at most ``chars`` characters, else its start and a marker saying how much was cut."""
    if len(text) <= chars:
        return text
    keep = max(0, chars - 40)
    return f"{text[:keep]} ... [{len(text) - keep} characters cut]"


def trim_tree(tree: str, budget_tokens: int, focused_bid: str | None = None) -> str:
    """``tree`` cut to about ``budget_tokens``, keeping a window of whole lines around the focused element."""
    if estimate_tokens(tree) <= budget_tokens:
        return tree
    lines = tree.splitlines()
    budget = budget_tokens * CHARS_PER_TOKEN - 130  # room for the two cut markers
    centre = _focused_line(lines, focused_bid)
    lo = hi = centre if centre is not None else 0
    used = len(lines[lo]) + 1
    if used > budget:  # one overlong line (the focused one): keep its start
        lines[lo] = lines[lo][: max(budget, 16)]
        used = len(lines[lo]) + 1
    grew = True
    while grew:
        grew = False
        # below first (what follows the focus is what the agent acts on next), then above
        if hi + 1 < len(lines) and used + len(lines[hi + 1]) + 1 <= budget:
            hi += 1
            used += len(lines[hi]) + 1
            grew = True
        if lo > 0 and used + len(lines[lo - 1]) + 1 <= budget:
            lo -= 1
            used += len(lines[lo]) + 1
            grew = True
    out = []
    if lo > 0:
        out.append(f"... ({lo} lines above cut to fit the observation budget)")
    out.extend(lines[lo:hi + 1])
    if hi + 1 < len(lines):
        out.append(f"... ({len(lines) - hi - 1} lines below cut; scroll or act on visible elements)")
    return "\n".join(out)


def latest_chat(obs: dict) -> str | None:
    """The newest non-system chat message (the user's reply or the page's info), if any."""
    for m in reversed(obs.get("chat_messages") or []):
        if m.get("role") in ("user", "assistant", "info") and m.get("message"):
            return f"{m['role']}: {m['message']}"
    return None


def render(obs: dict, tree: str, budget_tokens: int, goal: str, feedback: str | None = None) -> str:
    """The observation text, within ``budget_tokens``: header (goal, page, feedback, error), then the trimmed tree."""
    chars = budget_tokens * CHARS_PER_TOKEN
    share = {k: max(48, int(v * chars)) for k, v in SHARES.items()}
    page = [f"URL: {cap(str(obs.get('url', '')), share['page'] // 2)}"]
    tabs = obs.get("open_pages_urls") or ()
    if len(tabs) > 1:
        active = obs.get("active_page_index")
        active = int(active[0]) if hasattr(active, "__len__") else active
        page.append("Tabs: " + "; ".join(f"{i}{'*' if i == active else ''} {cap(u, 80)}" for i, u in enumerate(tabs)))
    head = [f"# Goal\n{cap(goal, share['goal'])}", "# Page\n" + cap("\n".join(page), share["page"])]
    chat = latest_chat(obs)
    if chat and chat.split(": ", 1)[-1].strip() != goal.strip():  # the task's opening message repeats the goal
        head.append(f"# Latest message\n{cap(chat, share['message'])}")
    if feedback:
        head.append(f"# Feedback\n{cap(feedback, share['feedback'])}")
    err = obs.get("last_action_error")
    if err:
        head.append(f"# Error from the last action\n{cap(str(err), share['error'])}")
    head_text = "\n".join(head) + "\n# Accessibility tree\n"
    focused = obs.get("focused_element_bid") or None
    room = budget_tokens - estimate_tokens(head_text)
    text = head_text + (trim_tree(tree, room, focused) if room >= 48 else "")
    if len(text) > chars:  # a tiny budget: the parts' floors and the tree's markers may not fit
        text = cap(text, chars)
    return text
