"""BrowserGym observation -> the text the model reads, within a token budget.

Always kept: the goal, the URL and open tabs, the latest feedback (the newest
chat message and this environment's own parse feedback) and the last action's
error. The accessibility tree fills the rest: whole if it fits, else a window
of lines around the focused element (or from the top when nothing has focus),
with markers saying how many lines were cut. Tokens are estimated at
``CHARS_PER_TOKEN`` characters each: envs do not load the model's tokenizer.
"""
from __future__ import annotations

CHARS_PER_TOKEN = 4


def estimate_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


def _focused_line(lines: list[str], bid: str | None) -> int | None:
    if not bid:
        return None
    tag = f"[{bid}]"
    for i, line in enumerate(lines):
        if tag in line:
            return i
    return None


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
    """The observation text: fixed header (goal, page, feedback, error), then the trimmed tree."""
    head = [f"# Goal\n{goal}", f"# Page\nURL: {obs.get('url', '')}"]
    tabs = obs.get("open_pages_urls") or ()
    if len(tabs) > 1:
        active = obs.get("active_page_index")
        active = int(active[0]) if hasattr(active, "__len__") else active
        head.append("Tabs: " + "; ".join(f"{i}{'*' if i == active else ''} {u}" for i, u in enumerate(tabs)))
    chat = latest_chat(obs)
    if chat and chat.split(": ", 1)[-1].strip() != goal.strip():  # the task's opening message repeats the goal
        head.append(f"# Latest message\n{chat}")
    if feedback:
        head.append(f"# Feedback\n{feedback}")
    err = obs.get("last_action_error")
    if err:
        head.append(f"# Error from the last action\n{err}")
    head_text = "\n".join(head)
    focused = obs.get("focused_element_bid") or None
    room = max(budget_tokens - estimate_tokens(head_text), 32)
    return f"{head_text}\n# Accessibility tree\n{trim_tree(tree, room, focused)}"
