"""Content identities: file digests and a model directory's fingerprint (no path enters either).

A run's config hash must not change when the same model or task file is found
under another path (another node's mount, ``ESOPT_DATA``), and must change when
their content does.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import struct

_BLOCK = 1 << 20
# small files that decide how the model is built and how text becomes tokens
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
               "special_tokens_map.json", "vocab.json", "merges.txt")
SAMPLES = 16  # 64 KiB blocks read per safetensors file, spread over its data


def file_sha256(path: str, block: int = _BLOCK) -> str:
    """SHA-256 of a file's bytes, streamed (constant memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def safetensors_fingerprint(path: str, samples: int = SAMPLES, block: int = 1 << 16) -> str:
    """Digest of a safetensors file's header (names, dtypes, shapes, offsets), size and ``samples`` data blocks.

    Reading a few evenly spread blocks instead of the whole file keeps this
    cheap for a 50 GB checkpoint while any fine-tune (which changes nearly every
    weight) still changes it.
    """
    h = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise ValueError(f"{path}: truncated safetensors header ({n} bytes declared, file of {size})")
        h.update(head + f.read(n) + str(size).encode())
        data0, data_len = 8 + n, size - 8 - n
        if data_len <= samples * block:
            h.update(f.read())
            return h.hexdigest()
        for i in range(samples):  # first and last block included
            f.seek(data0 + (data_len - block) * i // (samples - 1))
            h.update(f.read(block))
    return h.hexdigest()


def model_fingerprint(model_dir: str) -> str:
    """Identity of an HF model directory by content: its config/tokenizer files and every weight file's fingerprint."""
    h = hashlib.sha256()
    for name in MODEL_FILES:
        p = os.path.join(model_dir, name)
        if os.path.isfile(p):
            h.update(f"{name}:{file_sha256(p)}\n".encode())
    weights = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not weights and not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"model.path: {model_dir} holds neither config.json nor *.safetensors")
    for p in weights:
        h.update(f"{os.path.basename(p)}:{safetensors_fingerprint(p)}\n".encode())
    return h.hexdigest()


def diff_identity(old: dict, new: dict, limit: int = 6) -> str:
    """The settings two identities (flat dicts of dotted keys) disagree on: ``"es.population 8 -> 4; ..."``."""
    keys = sorted(k for k in set(old) | set(new) if old.get(k, "<unset>") != new.get(k, "<unset>"))

    def show(v) -> str:
        s = json.dumps(v) if not isinstance(v, str) else v
        return s if len(s) <= 40 else s[:16] + "..."

    parts = [f"{k} {show(old.get(k, '<unset>'))} -> {show(new.get(k, '<unset>'))}" for k in keys[:limit]]
    if len(keys) > limit:
        parts.append(f"and {len(keys) - limit} more")
    return "; ".join(parts)
