"""Content hashes: the keys under which texts, generations and embeddings are shared."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from memgas.pipeline.errors import DataError


def text_hash(text: str) -> str:
    """128-bit hex digest of a text's UTF-8 bytes (collisions are negligible at 10^9 texts)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file, streamed (LongMemEval-M files are ~2.7 GB). A FIFO or a device is refused
    (DataError) before it is opened: opening a FIFO blocks until a writer comes, /dev/zero never ends."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise DataError(str(path), "not a regular file (a FIFO, device or directory); expected a dataset file")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
