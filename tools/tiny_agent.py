"""Tooling for the embedded tiny agent: its tokenizer, trained on the text it will read and write, and the
supervised warm start on scripted 4x4 Sudoku episodes (``tools/build_tiny_agent.py``).

A randomly initialised model never emits a valid action, so ES has no signal to climb. A short supervised run
on a scripted player's episodes (the exact token sequences the agent loop produces: ChatML opening,
``set r c v``, feedback deltas) teaches the format and some of the game; it is stopped early, while the agent
still fails often, so that ES has something left to learn.

The library only copies the resulting tokenizer (:func:`esopt_mp.models.tiny.build_tiny_agent_base`); building it
needs the environments and the agent's chat format, which the model code does not depend on.
"""
from __future__ import annotations

import logging
import os

import torch

from esopt_mp.chat.format import CHAT_TEMPLATE, IM_END, delta_text, opening_text
from esopt_mp.envs.math_react import generate as math_tasks
from esopt_mp.envs.sudoku import SudokuEnv, generate

log = logging.getLogger(__name__)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def default_corpus() -> list[str]:
    """Text the tiny agent will read and write: rendered Sudoku prompts, actions, feedback, math."""
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
    """Train (or load, if ``path`` exists) a byte-level BPE tokenizer with Qwen's special tokens and chat template,
    and save it as a HF tokenizer: a vocabulary a tiny model can afford, treated by the agent loop like the real one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(path)
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


def scripted_episode(task: dict, max_turns: int, env_kwargs: dict | None = None) -> list[tuple[str, bool]]:
    """(text, is_assistant) segments of a perfect player's episode: the first empty cell each turn."""
    env = SudokuEnv(max_turns=max_turns, **(env_kwargs or {}))
    msgs, _ = env.reset(task)
    n = len(task["puzzle"])
    cells = [(r, c) for r in range(n) for c in range(n) if task["puzzle"][r][c] == 0]
    segments = [(opening_text(msgs), False)]
    for r, c in cells:
        action = f"set {r + 1} {c + 1} {task['solution'][r][c]}"
        segments.append((action + IM_END, True))
        msgs, reward, term, trunc, _ = env.step(action)
        if term or trunc:
            break
        segments.append((delta_text(True, msgs), False))
    return segments


def encode_examples(tok, tasks: list[dict], max_turns: int,
                    env_kwargs: dict | None = None) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per episode; labels are -100 outside the assistant's tokens."""
    out = []
    for task in tasks:
        ids, labels = [], []
        for text, is_assistant in scripted_episode(task, max_turns, env_kwargs):
            t = tok.encode(text, add_special_tokens=False)
            ids += t
            labels += t if is_assistant else [-100] * len(t)
        out.append((ids, labels))
    return out


def train_sft_(model, examples, *, steps: int, lr: float = 3e-3, batch: int = 16, seed: int = 0,
               pad_id: int = 0, log_every: int = 50) -> list[float]:
    """AdamW on the assistant tokens of ``examples``; returns the loss per step."""
    g = torch.Generator().manual_seed(seed)
    model.train()
    model.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    losses = []
    for step in range(steps):
        idx = torch.randint(len(examples), (batch,), generator=g).tolist()
        width = max(len(examples[i][0]) for i in idx)
        ids = torch.full((batch, width), pad_id)
        labels = torch.full((batch, width), -100)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for row, i in enumerate(idx):
            x, y = examples[i]
            ids[row, : len(x)], labels[row, : len(y)], mask[row, : len(x)] = torch.tensor(x), torch.tensor(y), 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log_every and step % log_every == 0:
            log.info("warm start step %d: loss %.4f", step, losses[-1])
    model.eval()
    model.requires_grad_(False)
    return losses
