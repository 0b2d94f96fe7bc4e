"""Content hashes: the keys under which texts, generations and embeddings are shared."""

from __future__ import annotations

import hashlib
from pathlib import Path


def text_hash(text: str) -> str:
    """128-bit hex digest of a text's UTF-8 bytes (collisions are negligible at 10^9 texts)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file, streamed (LongMemEval-M files are ~2.7 GB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
