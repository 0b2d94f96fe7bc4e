"""A history's saved full IVF index as a file that faiss maps instead of reading: a copy of its ``ivf_index``
part's index bytes (faiss's own format), derived from the part and kept beside it.

Why: at 10^6 sessions the saved index is ~1.5 GB. An append's driver read it from its Parquet part and loaded
it into faiss (~26 s: most of it first touches of fresh memory), to search the lists that 4,000 new rows
probe. Mapped (:func:`~memgas.pipeline.association.faiss_index.raw_from_file`), opening it reads the header
and the centroids, and a search reads the lists it probes, from the page cache once read; the deltas and the
walk's blocks are kept apart in memory and searched after the mapped lists
(:meth:`~memgas.pipeline.association.ivf_search.CausalIVF.stacked`: the same results, bit for bit).

Where: ``<bank>/ivf_index/_mapped/<history key>-<part key>-<content digest>.faiss``. The part key names the
part and the digest its marker records, so a part written again never finds an old copy; the content digest
is that of the copy's bytes (:func:`memgas.pipeline.hashing.file_digest`'s hash), computed while they are
written from a verified part. A copy is used only where its bytes have that digest: hashed at its first use
by a later command, which records it (:mod:`memgas.pipeline.bank_verified`), then trusted while the file is
unchanged. A copy that fails is deleted and written again from the part; writing one deletes the history's
other copies, and the stage's end deletes the copies of parts no longer in the table (:func:`prune`).
Deleting the folder costs one read of the part.
Where no copy can be written (a full disk, a read-only bank), the index is read from the part as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from memgas.pipeline import faults
from memgas.pipeline.bank_files import mkstemp_beside
from memgas.pipeline.bank_verified import hash_and_record, verified_before

log = logging.getLogger(__name__)

#: the copies' folder inside the ``ivf_index`` table's folder (not a part: parts are ``*.parquet`` with a marker)
MAPPED_DIR = "_mapped"
#: the saved full indexes' table (jobs/stages/associate.py writes it)
TABLE = "ivf_index"


def _key(*fields: str) -> str:
    return hashlib.blake2b("\0".join(fields).encode("utf-8", "surrogatepass"), digest_size=10).hexdigest()


def folder(bank: object) -> Path:
    """Where the copies of ``bank``'s saved indexes are kept."""
    return Path(bank.path) / TABLE / MAPPED_DIR


def mapped_copy(bank: object, part: str, history: str, chunks: Callable[[], Sequence[np.ndarray]]) -> Path | None:
    """The path of a copy of ``history``'s saved index in ``part`` whose bytes are those of the part: one
    found and checked, else written from ``chunks()`` (the part's index bytes, verified, in order). None
    when the part has no recorded digest or no copy could be written (logged: the caller reads the part)."""
    part_digest = bank.part_digest(TABLE, part)
    if part_digest is None:
        return None
    d = folder(bank)
    hist = _key(history)
    prefix = f"{hist}-{_key(part, part_digest)}-"
    for f in sorted(d.glob(f"{prefix}*.faiss")) if d.is_dir() else []:
        digest = f.name[len(prefix) : -len(".faiss")]
        if verified_before(f, digest, None) or hash_and_record(f, digest, None):
            return f
        log.warning("associate: the mapped copy %s of a saved IVF index is not the bytes written; writing it "
                    "again from %s/%s", f, TABLE, part)
        f.unlink(missing_ok=True)
    try:
        return _write(d, prefix, hist, chunks())
    except OSError as exc:
        log.warning("associate: no mapped copy of the saved IVF index of history %s (%s); reading it from its "
                    "part", history, exc)
        return None


def _write(d: Path, prefix: str, hist: str, chunks: Sequence[np.ndarray]) -> Path:
    """Write the copy (temporary file, fsync, rename: a reader never sees half of one), hashing its bytes as
    they go, then delete the history's other copies."""
    h = hashlib.blake2b(digest_size=8)  # file_digest's hash: a later command checks the copy with it
    fd, tmp = mkstemp_beside(d / f"{prefix}.faiss")  # ".<name>.<random>.tmp", the bank's file mode
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                b = memoryview(np.ascontiguousarray(c, np.uint8))
                h.update(b)
                f.write(b)
            f.flush()
            os.fsync(f.fileno())
        faults.hit("ivf:mapped-copy:before-rename")
        path = d / f"{prefix}{h.hexdigest()}.faiss"
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for old in d.glob(f"{hist}-*.faiss"):
        if old != path:
            old.unlink(missing_ok=True)
    return path


def prune(bank: object) -> int:
    """Delete the copies (and temporary files a killed write left) of parts no longer in the table: a
    superseded full index's copy would otherwise stay (~1.5 GB at 10^6 sessions) until its history's next
    copy is written. Returns how many files were deleted."""
    d = folder(bank)
    if not d.is_dir():
        return 0
    keep = set()
    for part in bank.parts(TABLE):
        digest = bank.part_digest(TABLE, part)
        if digest is not None:
            for h in set(bank.read(TABLE, ["history_id"], parts=[part])["history_id"].to_pylist()):
                keep.add(f"{_key(h)}-{_key(part, digest)}-")
    gone = 0
    for f in d.iterdir():
        if (f.name.startswith(".") and f.suffix == ".tmp") or \
                (f.suffix == ".faiss" and f.name[: f.name.rindex("-") + 1] not in keep):
            f.unlink(missing_ok=True)
            gone += 1
    return gone
