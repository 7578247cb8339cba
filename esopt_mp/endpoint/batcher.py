"""The served member's waiting requests, gathered into the engine's batches on the serving thread.

Lockstep: a batch is generated as soon as every live episode (as the caller counts them) has a request waiting,
else ``batch_window_s`` after the oldest waiting request; rows are ordered by (episode, conversation), so the same
requests make the same batch. The generation runs on the caller's thread (at tp > 1 inside ``TPEngine.lead``,
so the peers join every forward); the HTTP side tokenises a request (:func:`encode_turn`), enqueues it and waits.
"""
from __future__ import annotations

import dataclasses
import json
import threading
from typing import Callable

from esopt_mp.chat.format import IM_END
from esopt_mp.endpoint.protocol import RequestError
from esopt_mp.endpoint.render import continuation_text, parse_reply, prompt_text
from esopt_mp.endpoint.sessions import Thread
from esopt_mp.engine.base import SamplingParams, generate_capped


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
    ids: list[int] | None = None  # this turn's new token ids, tokenised when it was submitted (None: not yet)
    member: int = -1  # its member's slot in the engine (es.member_batch), -1: the engine's weights as they are


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
    """Waiting requests of one member, or of the members served at once; every method but :func:`generate` runs
    under ``cond``."""

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

    def drain(self, member: int | None = None) -> list[Pending]:
        """The waiting requests (of member slot ``member`` only, when given), taken out."""
        out = [p for p in self.pending if member is None or p.member == member]
        self.pending = [p for p in self.pending if not (member is None or p.member == member)]
        return out


def token_bound(tok) -> tuple[int, object] | None:
    """(the most characters one token can stand for, the tokenizer's normalizer) of a byte-level BPE tokenizer
    (Qwen's, Llama 3's): a token's vocabulary string has a character per byte it stands for (an added token's, its
    own text), so a text of ``n`` characters, once normalised, is at least ``n / most`` tokens. None for other
    tokenizers (a WordPiece ``[UNK]`` stands for a whole word, a whitespace pre-tokenizer drops characters)."""
    backend = getattr(tok, "backend_tokenizer", None)
    try:
        kinds = json.dumps(json.loads(backend.pre_tokenizer.__getstate__()))
    except Exception:  # noqa: BLE001 - a slow tokenizer, no pre-tokenizer: no bound
        return None
    if '"type": "ByteLevel"' not in kinds:
        return None
    return max(map(len, tok.get_vocab())), backend.normalizer


def min_tokens(text: str, bound: tuple[int, object] | None, need: int) -> int:
    """A floor on ``text``'s token count, without tokenising it (0 without a bound); exact enough to tell whether
    it reaches ``need`` (the normalizer runs only for a text that would, by its raw length)."""
    if bound is None:
        return 0
    most, norm = bound
    floor = -(-len(text) // most)
    if floor >= need and norm is not None:  # a normalizer may join characters (NFC): count what it leaves
        floor = -(-len(norm.normalize_str(text)) // most)
    return floor


def too_long(tokens: int, limit: int, at_least: bool = False) -> RequestError:
    return RequestError(400, f"messages: this conversation is {'at least ' if at_least else ''}{tokens} tokens; the "
                             f"model takes at most {limit} (prompt and reply)", "messages", "context_length_exceeded")


def turn_text(p: Pending) -> str:
    """What ``p`` adds to its conversation: a new one's whole prompt, else the delta after its last reply."""
    return prompt_text(p.new, p.tools) if p.fresh else continuation_text(p.thread.ended_clean, p.new)


def encode_turn(tok, p: Pending, n0: int, limit: int | None, bound=None) -> list[int] | RequestError:
    """``p``'s new token ids, or its 400 when its conversation (``n0`` tokens so far) would not fit ``limit`` with
    one more token: refused by its length alone when :func:`min_tokens` already reaches the limit, so a huge
    message is never tokenised."""
    text = turn_text(p)
    if limit:
        floor = n0 + min_tokens(text, bound, limit - n0)
        if floor >= limit:
            return too_long(floor, limit, at_least=True)
    ids = tok.encode(text, add_special_tokens=False)
    if limit and n0 + len(ids) >= limit:
        return too_long(n0 + len(ids), limit)
    return ids


def generate(engine, batch: list[Pending], sampling: SamplingParams, parser: str, next_cid,
             tokenizer=None) -> list[Turn | RequestError]:
    """One engine batch for ``batch`` (a new conversation opens here, on the serving thread); a request whose
    conversation would not fit the engine's context with one more token is answered with its 400 instead. A
    request is tokenised here only if it was not when submitted (no tokenizer was known then)."""
    tok = tokenizer if tokenizer is not None else engine.tokenizer
    im_end = tok.convert_tokens_to_ids(IM_END)
    limit = getattr(engine, "max_context", None)
    convs, new_ids, before, keep, out = [], [], [], [], [None] * len(batch)
    for k, p in enumerate(batch):
        t = p.thread
        ids = p.ids if p.ids is not None else tok.encode(turn_text(p), add_special_tokens=False)
        n0 = 0 if p.fresh else len(t.conv.ids)
        if limit and n0 + len(ids) >= limit:
            out[k] = too_long(n0 + len(ids), limit)
            continue
        if p.fresh:
            t.conv = engine.new_conversation(next_cid(), t.seed, join=True, **(
                {"member": p.member} if p.member != -1 else {}))
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
