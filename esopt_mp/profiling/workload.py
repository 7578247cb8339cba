"""The fixed workload every profile runs: same batch, same prompts, same number of generated tokens.

``batch`` conversations of ``turns`` turns: the first turn feeds
``first_prompt`` fixed token ids, each later turn ``turn_prompt`` more (the
environment's reply), and every turn generates exactly ``new_tokens`` (EOS is
ignored: a random-weight model would otherwise stop at random places and two
profiles would not generate the same tokens). The context a conversation
reaches is ``first_prompt + turns * new_tokens + (turns - 1) * turn_prompt``.
Rollouts run through :class:`esopt_mp.engine.hf.HFEngine`, the engine ES
training uses, so KV and recurrent state are what training holds.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Workload:
    batch: int = 4
    turns: int = 2
    first_prompt: int = 32
    turn_prompt: int = 8
    new_tokens: int = 8
    group_size: int = 2  # GRPO generations per task: tasks = batch // group_size

    def __post_init__(self):
        for k in ("batch", "turns", "first_prompt", "new_tokens", "group_size"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{k.replace('_', '-')} must be a positive integer, got {v!r}")
        if not isinstance(self.turn_prompt, int) or self.turn_prompt < (1 if self.turns > 1 else 0):
            raise ValueError(f"--turn-prompt must be a positive integer when --turns > 1, got {self.turn_prompt!r}")
        if self.batch % self.group_size:
            raise ValueError(f"--batch {self.batch} must be a multiple of --group-size {self.group_size}")

    @property
    def context(self) -> int:
        return self.first_prompt + self.turns * self.new_tokens + (self.turns - 1) * self.turn_prompt

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), context=self.context)


def build_tokenizer(vocab_size: int):
    """A word-level fast tokenizer over the model's whole vocabulary (``<pad>``, ``t1`` ... ``tN-1``).

    The engine needs a real tokenizer object (pad id, decode); the token ids
    are fixed, so the tokenizer never splits text and carries no EOS token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


def prompt_ids(wl: Workload, vocab_size: int, seed: int = 0) -> list[list[list[int]]]:
    """Per conversation, per turn: the fixed ids fed before that turn's generation."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(wl.batch):
        turns = [torch.randint(1, vocab_size, (wl.first_prompt,), generator=g).tolist()]
        turns += [torch.randint(1, vocab_size, (wl.turn_prompt,), generator=g).tolist() for _ in range(wl.turns - 1)]
        out.append(turns)
    return out


def make_engine(model, tokenizer):
    """The training engine with EOS ignored, so every conversation generates ``new_tokens`` per turn."""
    from esopt_mp.engine.hf import HFEngine

    engine = HFEngine(model, tokenizer)
    engine.eos = set()
    return engine


def run_rollouts(engine, wl: Workload, seed: int = 0) -> list:
    """All ``wl.batch`` conversations, turn by turn, batched; returns the engine's conversations."""
    from esopt_mp.engine.base import SamplingParams

    prompts = prompt_ids(wl, engine.model.config.vocab_size, seed)
    convs = [engine.new_conversation(i, seed * 100003 + i) for i in range(wl.batch)]
    params = SamplingParams(max_new_tokens=wl.new_tokens)
    for turn in range(wl.turns):
        gens = engine.generate(convs, [p[turn] for p in prompts], params)
        bad = [g.finish for g in gens if len(g.token_ids) != wl.new_tokens]
        if bad:
            raise RuntimeError(f"a conversation stopped early ({bad}); the workload needs fixed-length turns")
    return convs


def spans(wl: Workload) -> list[tuple[int, int]]:
    """[start, end) of each turn's generated tokens inside a conversation's ids."""
    out, pos = [], wl.first_prompt
    for turn in range(wl.turns):
        out.append((pos, pos + wl.new_tokens))
        pos += wl.new_tokens + wl.turn_prompt
    return out


def token_batch(convs, wl: Workload, seed: int = 0):
    """The rollouts as a baselines ``TokenBatch``: the same episodes the other profiles generated.

    Rewards are fixed pseudo-random returns (an update's memory does not depend on their values).
    """
    from esopt_mp.baselines.batch import TokenBatch

    ids = torch.tensor([c.ids for c in convs], dtype=torch.long)
    n, t = ids.shape
    if t != wl.context:
        raise RuntimeError(f"conversations hold {t} tokens, the workload says {wl.context}")
    loss_mask = torch.zeros(n, t, dtype=torch.bool)
    turn_end = torch.zeros(n, t, dtype=torch.bool)
    for a, b in spans(wl):
        loss_mask[:, a:b] = True
        turn_end[:, b - 1] = True
    g = torch.Generator().manual_seed(seed)
    return TokenBatch(input_ids=ids, attention_mask=torch.ones(n, t, dtype=torch.long), loss_mask=loss_mask,
                      turn_end=turn_end, rewards=torch.rand(n, generator=g),
                      group=torch.arange(n) // wl.group_size)
