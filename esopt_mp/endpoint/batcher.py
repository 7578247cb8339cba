"""The served member's waiting requests, gathered into the engine's batches on the serving thread.

Lockstep: a batch is generated as soon as every live episode (as the caller counts them) has a request waiting,
else ``batch_window_s`` after the oldest waiting request; rows are ordered by (episode, conversation), so the same
requests make the same batch. The generation runs on the caller's thread (at tp > 1 inside ``TPEngine.lead``,
so the peers join every forward); the HTTP threads only enqueue and wait.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable

from esopt_mp.agent.chat import IM_END
from esopt_mp.endpoint.protocol import RequestError
from esopt_mp.endpoint.render import continuation_text, parse_reply, prompt_text
from esopt_mp.endpoint.sessions import Thread
from esopt_mp.engine.base import generate_capped
from esopt_mp.engine.sampling import SamplingParams


@dataclasses.dataclass
class Pending:
    """One chat request waiting for its reply."""
    episode: int  # the route's episode index (the plain routes': after every episode)
    thread: Thread
    messages: list  # the request's whole history
    new: list  # what this turn renders: every message for a new conversation, else those after its history
    fresh: bool
    tools: list | None
    parse: bool  # read tool calls from the reply (tools offered and tool_choice is not "none")
    cap: int | None  # the request's max_tokens
    arrived: float
    deliver: Callable[[object], None]  # called once: a Turn, or an error the HTTP side turns into its response


@dataclasses.dataclass
class Turn:
    """A generated reply and its accounting."""
    text: str
    content: str | None
    tool_calls: list
    finish_reason: str
    prompt_tokens: int  # the whole prompt: the conversation so far and this turn's new tokens
    completion_tokens: int
    cached_tokens: int  # prompt tokens the engine did not prefill again (its conversation cache)
    ended_clean: bool


class Batcher:
    """Waiting requests of one member; every method but :func:`generate` runs under ``cond``."""

    def __init__(self, cond: threading.Condition, window_s: float, episodes: int):
        self.cond, self.window_s, self.episodes = cond, window_s, episodes
        self.pending: list[Pending] = []

    def put(self, item: Pending) -> None:
        self.pending.append(item)
        self.cond.notify_all()

    def take(self, live: int, now: float) -> list[Pending] | None:
        """The next batch, if it is due: every live episode waits, or the oldest request waited the window."""
        if not self.pending:
            return None
        waiting = {p.episode for p in self.pending if p.episode < self.episodes}
        if len(waiting) < live and now - min(p.arrived for p in self.pending) < self.window_s:
            return None
        batch, self.pending = sorted(self.pending, key=lambda p: (p.episode, p.thread.ordinal)), []
        return batch

    def wait_s(self, now: float, poll_s: float) -> float:
        """How long to sleep before the next check (a new request wakes the sleeper earlier)."""
        if not self.pending:
            return poll_s
        return max(0.0, min(poll_s, min(p.arrived for p in self.pending) + self.window_s - now))

    def drain(self) -> list[Pending]:
        out, self.pending = self.pending, []
        return out


def generate(engine, batch: list[Pending], sampling: SamplingParams, parser: str, next_cid,
             tokenizer=None) -> list[Turn | RequestError]:
    """One engine batch for ``batch`` (a new conversation opens here, on the serving thread); a request whose
    conversation would not fit the engine's context with one more token is answered with its 400 instead."""
    tok = tokenizer if tokenizer is not None else engine.tokenizer
    im_end = tok.convert_tokens_to_ids(IM_END)
    limit = getattr(engine, "max_context", None)
    convs, new_ids, before, keep, out = [], [], [], [], [None] * len(batch)
    for k, p in enumerate(batch):
        t = p.thread
        text = prompt_text(p.new, p.tools) if p.fresh else continuation_text(t.ended_clean, p.new)
        ids = tok.encode(text, add_special_tokens=False)
        n0 = 0 if p.fresh else len(t.conv.ids)
        if limit and n0 + len(ids) >= limit:
            out[k] = RequestError(400, f"messages: this conversation is {n0 + len(ids)} tokens; the model takes at "
                                       f"most {limit} (prompt and reply)", "messages", "context_length_exceeded")
            continue
        if p.fresh:
            t.conv = engine.new_conversation(next_cid(), t.seed, join=True)
        convs.append(t.conv)
        new_ids.append(ids)
        before.append(n0)
        keep.append(k)
    if not keep:
        return out
    caps = None
    if any(batch[k].cap is not None for k in keep):
        caps = [min(sampling.max_new_tokens, batch[k].cap or sampling.max_new_tokens) for k in keep]
    gens = generate_capped(engine, convs, new_ids, sampling, caps)
    for k, g, ids, n0 in zip(keep, gens, new_ids, before):
        p = batch[k]
        prefix = f"call_{p.episode}_{p.thread.ordinal}_{p.thread.turns}_"
        content, calls, finish = parse_reply(g.text, parser, p.tools if p.parse else None, g.finish, prefix)
        prompt = n0 + len(ids)
        out[k] = Turn(g.text, content, calls, finish, prompt, len(g.token_ids), max(0, prompt - g.prefill_tokens),
                      bool(g.token_ids) and g.token_ids[-1] == im_end)
    return out
