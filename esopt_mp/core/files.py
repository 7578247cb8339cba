"""A file's content digest, the one way every layer hashes a file (a model file checked against its published
SHA-256, a checkpoint's manifest, the run identity of a model or task file)."""
from __future__ import annotations

import hashlib

BLOCK = 1 << 20


def file_sha256(path: str, block: int = BLOCK) -> str:
    """SHA-256 of a file's bytes, streamed (constant memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()
