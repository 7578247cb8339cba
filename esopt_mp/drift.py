"""Off-task drift: how far a fine-tune moved a model away from its start, outside the task it was trained on.

Two measures between a start and an end model:

- the off-task negative log-likelihood: the mean per-token NLL of a fixed set of ordinary English paragraphs
  shipped with the package (``esopt_mp/data/offtask/texts.json``, written for this project: history, nature,
  cooking...; nothing about arithmetic or puzzles), under each model; its change is the drift;
- the size of the update: the L2 norm of theta_end - theta_start over all parameters, in fp32, and that norm over
  ||theta_start||.

A library module: it imports neither the trainer nor the tools. The models are loaded with transformers'
``AutoModelForCausalLM`` in fp32 on the CPU (or the device asked for); nothing here trains, samples or writes.

    from esopt_mp.drift import drift
    drift("runs/default/base_model", "runs/default/export")
    # {"offtask_nll_start": ..., "offtask_nll_end": ..., "offtask_nll_delta": ..., "update_norm": ...,
    #  "relative_update_norm": ...}
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import torch

from esopt_mp.data import data_path

OFFTASK = "offtask/texts.json"  # under the data root (esopt_mp/data, or $ESOPT_DATA)
MAX_TOKENS = 256  # per text: the shipped paragraphs are shorter, so none is cut with a real tokenizer
BATCH = 8

__all__ = ["OFFTASK", "drift", "load_fp32_model", "offtask_nll", "offtask_texts", "update_norms"]


def offtask_texts(path: str | None = None) -> list[str]:
    """The off-task paragraphs: ``path`` (a JSON file ``{"texts": [...]}`` or a list), default the shipped set."""
    with open(path or data_path(OFFTASK), encoding="utf-8") as f:
        doc = json.load(f)
    texts = doc["texts"] if isinstance(doc, dict) else doc
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t.strip() for t in texts):
        raise ValueError(f"{path or OFFTASK}: expected a non-empty list of non-empty strings under 'texts'")
    return texts


def _encode(tokenizer, texts: Sequence[str], max_tokens: int) -> list[list[int]]:
    ids = [list(tokenizer(t, add_special_tokens=True)["input_ids"])[:max_tokens] for t in texts]
    short = [i for i, x in enumerate(ids) if len(x) < 2]
    if short:
        raise ValueError(f"texts {short[:5]} give fewer than 2 tokens: nothing to predict")
    return ids


@torch.no_grad()
def offtask_nll(model, tokenizer, texts: Sequence[str] | None = None, max_tokens: int = MAX_TOKENS,
                batch_size: int = BATCH) -> float:
    """Mean per-token negative log-likelihood (nats) of ``texts`` under ``model`` (default: the shipped set).

    Each text is tokenized on its own (the tokenizer's special tokens included), cut to its first ``max_tokens``
    tokens, and every token after the first is predicted from the ones before it; the mean is over all those
    tokens of all texts (longer texts weigh more). Batches of ``batch_size`` texts, right-padded and masked, in
    the given order, no grad, the model in eval mode: the same model, texts and settings give the same number.
    """
    if max_tokens < 2 or batch_size < 1:
        raise ValueError(f"max_tokens must be >= 2 and batch_size >= 1, got {max_tokens}, {batch_size}")
    texts = offtask_texts() if texts is None else list(texts)
    ids = _encode(tokenizer, texts, max_tokens)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for a in range(0, len(ids), batch_size):
            rows = ids[a : a + batch_size]
            n = max(len(r) for r in rows)
            x = torch.full((len(rows), n), pad, dtype=torch.long)
            mask = torch.zeros((len(rows), n), dtype=torch.long)
            for i, r in enumerate(rows):
                x[i, : len(r)] = torch.tensor(r, dtype=torch.long)
                mask[i, : len(r)] = 1
            x, mask = x.to(device), mask.to(device)
            logits = model(input_ids=x, attention_mask=mask, use_cache=False).logits[:, :-1].float()
            target = x[:, 1:].masked_fill(mask[:, 1:] == 0, -100)  # padding predicts nothing
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                    ignore_index=-100, reduction="sum")
            total += float(nll)
            count += int((target != -100).sum())
    finally:
        model.train(was_training)
    return total / count


def update_norms(start, end) -> tuple[float, float]:
    """(||theta_end - theta_start||, ||theta_start||), L2 over every parameter (tied ones once), each tensor's
    difference and norm in fp32, the tensors' squares summed in float64. The parameter names and shapes must
    match."""
    a, b = dict(start.named_parameters()), dict(end.named_parameters())
    if a.keys() != b.keys():
        raise ValueError(f"the models' parameters differ: {sorted(a.keys() ^ b.keys())[:5]}")
    diff_sq = start_sq = 0.0
    for name, s in a.items():
        e = b[name]
        if s.shape != e.shape:
            raise ValueError(f"{name}: shape {tuple(s.shape)} at the start, {tuple(e.shape)} at the end")
        s32, e32 = s.detach().float(), e.detach().to(device=s.device, dtype=torch.float32)
        diff_sq += float(torch.linalg.vector_norm(e32 - s32)) ** 2
        start_sq += float(torch.linalg.vector_norm(s32)) ** 2
    return math.sqrt(diff_sq), math.sqrt(start_sq)


def load_fp32_model(path: str, device: str | torch.device = "cpu"):
    """An HF model directory as ``AutoModelForCausalLM`` in fp32, eval mode, no grad (local files only)."""
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is not a model directory")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def _tokenizer_of(*sources):
    from transformers import AutoTokenizer

    errors = []
    for src in sources:
        if isinstance(src, (str, os.PathLike)):
            try:
                return AutoTokenizer.from_pretrained(os.fspath(src), local_files_only=True)
            except (OSError, ValueError) as e:
                errors.append(f"{src}: {e}")
    raise ValueError("no tokenizer: pass tokenizer=, or a model directory that holds one"
                     + (f" ({'; '.join(errors)})" if errors else ""))


def drift(start, end, tokenizer=None, texts: Sequence[str] | None = None, max_tokens: int = MAX_TOKENS,
          batch_size: int = BATCH, device: str | torch.device = "cpu") -> dict:
    """The off-task drift from ``start`` to ``end``: each an HF model directory (loaded in fp32) or a loaded model.

    ``tokenizer``: default the start directory's (else the end's). Returns ``offtask_nll_start``,
    ``offtask_nll_end``, ``offtask_nll_delta`` (end - start, nats per token; > 0: the end model finds ordinary
    prose less likely), ``update_norm`` (||theta_end - theta_start||_2 over all parameters, fp32) and
    ``relative_update_norm`` (that over ||theta_start||_2).
    """
    tok = tokenizer or _tokenizer_of(start, end)
    models = [load_fp32_model(os.fspath(m), device) if isinstance(m, (str, os.PathLike)) else m for m in (start, end)]
    texts = offtask_texts() if texts is None else list(texts)
    nll = [offtask_nll(m, tok, texts, max_tokens, batch_size) for m in models]
    norm, base = update_norms(*models)
    return {"offtask_nll_start": nll[0], "offtask_nll_end": nll[1], "offtask_nll_delta": nll[1] - nll[0],
            "update_norm": norm, "relative_update_norm": norm / base if base else (0.0 if norm == 0 else math.inf)}
