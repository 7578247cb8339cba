"""A small byte-level BPE tokenizer trained locally (no hub), with the ChatML template.

Tiny agents need a vocabulary a tiny model can afford; the special tokens and
the chat template match Qwen's, so the agent loop treats it like the real one.
"""
from __future__ import annotations

import os

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def default_corpus() -> list[str]:
    """Text the tiny agent will read and write: rendered Sudoku prompts, actions, feedback, math."""
    from esopt_mp.agent.chat import opening_text
    from esopt_mp.envs.math_react import generate as math_tasks
    from esopt_mp.envs.sudoku import SudokuEnv, generate

    texts = []
    env = SudokuEnv()
    for size, blanks in ((4, 4), (4, 8), (9, 5), (9, 15)):
        for row in generate(30, blanks, size=size, seed=blanks):
            msgs, _ = env.reset(row)
            texts.append(opening_text(msgs))
            for r in range(size):
                for c in range(size):
                    texts.append(f"set {r + 1} {c + 1} {(r + c) % size + 1}")
                    texts.append(env._apply(f"set {r + 1} {c + 1} {(r * c) % size + 1}"))
    texts += [row["question"] + f" \\boxed{{{row['answer']}}}" for row in math_tasks(200, seed=0)]
    return texts


def build_tokenizer(path: str, vocab_size: int = 512, corpus: list[str] | None = None):
    """Train (or load, if ``path`` exists) a byte-level BPE tokenizer and save it as a HF tokenizer."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from esopt_mp.agent.chat import CHAT_TEMPLATE

    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(path)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus or default_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, additional_special_tokens=SPECIALS[1:2])
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return fast
