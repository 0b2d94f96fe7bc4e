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


#: digests this process computed, by (path, size, mtime, ctime, inode): a file is read once per process
#: unless it changed (ctime moves on every write and cannot be set back by a user)
_DIGESTS: dict[tuple[str, int, int, int, int], str] = {}


def file_digest(path: str | Path) -> str:
    """64-bit blake2b hex digest of a file's bytes (integrity of bank parts and model files), cached per
    process while the file is unchanged."""
    st = os.stat(path)
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    digest = _DIGESTS.get(key)
    if digest is None:
        h = hashlib.blake2b(digest_size=8)
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if len(_DIGESTS) > 100_000:
            _DIGESTS.clear()
        digest = _DIGESTS[key] = h.hexdigest()
    return digest


def model_files_digest(path: str | Path) -> str | None:
    """Digest of a model's files (one file, or every file under a folder except hidden ones): a model whose
    weights change in place gets another digest, which keys everything it computed. None when ``path`` is
    not on this machine (a hub name: its name, in the config, is all there is to key by)."""
    p = Path(path).expanduser()
    if not p.exists():
        return None
    files = [p] if p.is_file() else sorted(
        f for f in p.rglob("*") if f.is_file() and not any(x.startswith(".") for x in f.relative_to(p).parts))
    h = hashlib.blake2b(digest_size=8)
    for f in files:
        h.update(f"{f.name if p.is_file() else f.relative_to(p)}|{file_digest(f)}\n".encode())
    return h.hexdigest()
