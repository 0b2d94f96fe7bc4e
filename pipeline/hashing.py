"""Content hashes: the keys under which texts, generations and embeddings are shared."""

from __future__ import annotations

import errno
import io
import hashlib
import os
import stat
from pathlib import Path
from typing import BinaryIO

from memgas.pipeline.errors import DataError


def text_hash(text: str) -> str:
    """128-bit hex digest of a text's UTF-8 bytes (collisions are negligible at 10^9 texts)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


class NotARegularFile(OSError):
    """A path whose target (symlinks followed) is not a regular file: a FIFO, a device, a directory, a socket.

    An OSError, so callers that treat an unreadable file as damaged treat this one so too."""


def open_regular(path: str | Path) -> BinaryIO:
    """``path`` opened for reading, or :class:`NotARegularFile` before a byte is read.

    The one home of this check, for every file memgas hashes (datasets, bank parts, model caches). Symlinks are
    followed (model hubs keep their files as links to blobs) and the *target* must be a regular file: a FIFO
    blocks its reader until a writer comes and /dev/zero never ends, so hashing either never returns. The file
    is opened non-blocking (a FIFO's open then returns at once) and its type read from the open descriptor, so
    a file swapped between a check and the open cannot slip through."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _require_regular(os.fstat(fd).st_mode, path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_bytes(path: str | Path) -> bytes:
    """A small file's bytes (a manifest, a marker, a recorded digest) through :func:`open_regular`: a FIFO
    there raises :class:`NotARegularFile` instead of blocking the reader for ever."""
    with open_regular(path) as f:
        return f.read()


def regular_file_size(path: str | Path) -> int:
    """Size in bytes of a regular file (symlinks followed), or :class:`NotARegularFile`; reads nothing."""
    st = os.stat(path)
    _require_regular(st.st_mode, path)
    return st.st_size


def _require_regular(mode: int, path: str | Path) -> None:
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a directory" if stat.S_ISDIR(mode) else "a socket" if stat.S_ISSOCK(mode) else "another kind")
        raise NotARegularFile(errno.EINVAL, f"not a regular file: {kind}", str(path))


def file_matches(path: str | Path, digest: str, size: int | None = None) -> bool:
    """Whether ``path`` is a regular file of ``size`` bytes (when recorded) whose :func:`file_digest` is
    ``digest``. Type and size are checked before any byte is read; a missing or unreadable file is False."""
    try:
        if size is not None and regular_file_size(path) != size:
            return False
        return file_digest(path) == digest
    except OSError:
        return False


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file, streamed (LongMemEval-M files are ~2.7 GB). A FIFO or a device is refused
    (DataError) before a byte is read: opening a FIFO blocks until a writer comes, /dev/zero never ends."""
    try:
        f = open_regular(path)
    except NotARegularFile:
        raise DataError(str(path), "not a regular file (a FIFO, device or directory); expected a dataset file") from None
    h = hashlib.sha256()
    with f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


#: digests this process computed, by (path, size, mtime, ctime, inode): a file is read once per process
#: unless it changed (ctime moves on every write and cannot be set back by a user)
_DIGESTS: dict[tuple[str, int, int, int, int], str] = {}


def file_digest(path: str | Path) -> str:
    """64-bit blake2b hex digest of a file's bytes (integrity of bank parts and model files), cached per
    process while the file is unchanged. :class:`NotARegularFile` (an OSError) for a FIFO, device or folder."""
    with open_regular(path) as f:
        st = os.fstat(f.fileno())
        key = (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        digest = _DIGESTS.get(key)
        if digest is None:
            h = hashlib.blake2b(digest_size=8)
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


class DigestSink(io.RawIOBase):
    """A write-only file whose bytes go into a blake2b digest instead of memory. A table serialised into it
    (``pa.PythonFile(sink, mode="w")``: Arrow IPC, Parquet) is digested as it is written, the digest of the bytes
    a ``pa.BufferOutputStream`` would have held, without holding them (and their ``to_pybytes`` copy): two
    copies of the table's size fewer at 10^6 sessions."""

    def __init__(self, digest_size: int = 8) -> None:
        super().__init__()
        self._hash = hashlib.blake2b(digest_size=digest_size)
        self._written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        self._hash.update(data)
        self._written += len(data)
        return len(data)

    def tell(self) -> int:
        return self._written

    def hexdigest(self) -> str:
        return self._hash.hexdigest()
