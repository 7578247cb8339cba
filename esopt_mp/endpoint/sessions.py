"""Which engine conversation a chat request continues, so a follow-up turn prefills only its new messages.

A client sends the whole history every turn. The conversation whose messages (the requests' and the replies
returned) are the longest prefix of the new request's, followed only by non-assistant messages, is continued:
the member's own generated tokens stay as they are (never re-tokenised from the text the client echoes) and only
the new messages' delta is appended, as the in-process agent loop does. Otherwise a new conversation re-encodes
the whole history. Messages are compared normalised: role, text content, tool calls as (name, parsed
arguments); ids, ``type`` and None-vs-'' do not count.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from esopt_mp.endpoint.render import text_of
from esopt_mp.es.seeds import stream_seed


def _args(a) -> str:
    if isinstance(a, str):
        try:
            a = json.loads(a)
        except ValueError:
            return a
    return json.dumps(a, sort_keys=True, ensure_ascii=False)


def normalise(m: dict) -> tuple:
    """A message as conversations are matched by: (role, text, ((tool name, arguments), ...))."""
    role = "system" if m.get("role") == "developer" else m.get("role")
    text = text_of(m.get("content"))
    calls = tuple(((c.get("function") or c).get("name", ""), _args((c.get("function") or c).get("arguments")))
                  for c in m.get("tool_calls") or ())
    return role, text.strip() if role == "assistant" else text, calls


def tools_key(tools) -> str:
    return json.dumps(tools or [], sort_keys=True, ensure_ascii=False)


@dataclasses.dataclass
class Thread:
    """One engine conversation of an episode."""
    ordinal: int  # j: the episode's j-th conversation
    seed: int
    session: str | None  # the X-Session-ID it was opened under
    tools: str  # the tools it was rendered with (a continuation must offer the same)
    messages: list = dataclasses.field(default_factory=list)  # normalised, replies included
    conv: Any = None  # the engine's conversation (made on the serving thread; None once the member ended)
    ids: list = dataclasses.field(default_factory=list)  # its token ids, kept when the member ends
    ended_clean: bool = True  # the last reply ended with <|im_end|>
    busy: bool = True  # a request of it is waiting or generating
    turns: int = 0
    dead: bool = False  # its generation failed: never continued


class Sessions:
    """The conversations of one episode route; ``episode_seed`` seeds its first, :func:`stream_seed` the others."""

    def __init__(self, episode_seed: int):
        self.episode_seed = int(episode_seed)
        self.threads: list[Thread] = []

    def assign(self, session: str | None, messages: list[dict], tools) -> tuple[Thread, list[dict], bool]:
        """(conversation, messages to render, is it new) for a request; the conversation is marked busy."""
        norm, key = [normalise(m) for m in messages], tools_key(tools)
        best = None
        for t in self.threads:
            n = len(t.messages)
            if (t.busy or t.dead or not n or t.session != session or t.tools != key or n > len(norm)
                    or (best is not None and n <= len(best.messages))):
                continue
            if norm[:n] == t.messages and all(r[0] != "assistant" for r in norm[n:]):
                best = t
        if best is not None:
            best.busy = True
            return best, messages[len(best.messages):], False
        j = len(self.threads)
        seed = self.episode_seed if j == 0 else stream_seed(self.episode_seed, "conversation", j)
        t = Thread(j, seed, session, key)
        self.threads.append(t)
        return t, list(messages), True

    @staticmethod
    def record(t: Thread, messages: list[dict], reply: dict, ended_clean: bool) -> None:
        """The conversation now holds ``messages`` (the request's) and ``reply`` (what was returned)."""
        t.messages = [normalise(m) for m in messages] + [normalise(reply)]
        t.ended_clean, t.busy, t.turns = ended_clean, False, t.turns + 1
