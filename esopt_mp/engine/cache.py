"""Row operations on transformers' DynamicCache: select, stack (left-padded), extract.

Prefix reuse keeps one cache per conversation. Conversations that add equally
many tokens are prefilled together, and all live ones decode together, on a
stacked cache -- attention keys/values left-padded to a common length and
masked, linear-attention (Gated DeltaNet) conv and recurrent states
concatenated, so no padding passes through a recurrent layer -- split again
per conversation afterwards (esopt_mp/engine/prefill.py says why).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

_SEQ_DIM = 2  # keys/values: [batch, heads, seq, head_dim]


def _is_kv(layer) -> bool:
    return hasattr(layer, "keys") and torch.is_tensor(getattr(layer, "keys", None))


def _map_layer(layer, kv_fn, state_fn):
    new = copy.copy(layer)
    if _is_kv(layer):
        new.keys, new.values = kv_fn(layer.keys), kv_fn(layer.values)
    for attr in ("conv_states", "recurrent_states"):
        states = getattr(layer, attr, None)
        if isinstance(states, dict):
            setattr(new, attr, {k: state_fn(v) if torch.is_tensor(v) else v for k, v in states.items()})
    for attr in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
                 "conv_kernel_size"):
        if isinstance(getattr(layer, attr, None), dict):
            setattr(new, attr, dict(getattr(layer, attr)))
    return new


def _with_layers(cache, layers):
    new = copy.copy(cache)
    new.layers = layers
    return new


def select_rows(cache, rows: torch.Tensor):
    """The cache restricted to batch rows ``rows`` (copies)."""
    return _with_layers(cache, [_map_layer(l, lambda t: t.index_select(0, rows), lambda t: t.index_select(0, rows))
                                for l in cache.layers])


def extract_row(cache, row: int, pad: int):
    """Row ``row`` as a batch-1 cache, its ``pad`` left padding positions dropped."""
    return _with_layers(cache, [_map_layer(l, lambda t: t[row:row + 1, :, pad:].clone(),
                                           lambda t: t[row:row + 1].clone()) for l in cache.layers])


def stack(caches: list, lengths: list[int]):
    """One batch cache from batch-1 caches of ``lengths`` tokens; returns (cache, left pads)."""
    width = max(lengths)
    pads = [width - n for n in lengths]
    layers = []
    for per_row in zip(*(c.layers for c in caches)):
        first = per_row[0]
        new = copy.copy(first)
        if _is_kv(first):
            new.keys = torch.cat([F.pad(l.keys, (0, 0, p, 0)) for l, p in zip(per_row, pads)], 0)
            new.values = torch.cat([F.pad(l.values, (0, 0, p, 0)) for l, p in zip(per_row, pads)], 0)
        for attr in ("conv_states", "recurrent_states"):
            states = getattr(first, attr, None)
            if isinstance(states, dict):
                setattr(new, attr, {k: torch.cat([getattr(l, attr)[k] for l in per_row], 0) if torch.is_tensor(v)
                                    else v for k, v in states.items()})
        layers.append(new)
    return _with_layers(caches[0], layers), pads
