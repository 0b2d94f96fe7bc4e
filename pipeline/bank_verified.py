"""Parts verified before: a part whose bytes were hashed and found equal to its recorded digest is not hashed
again by a later command while its file is provably unchanged.

Why: every command verifies the parts it trusts (:meth:`memgas.pipeline.bank.Bank.verify_part`). At 10^6
sessions that is ~11 GB of ``embeddings`` for encode's skip check alone, plus the stored node blocks and the
saved IVF index: tens of seconds of hashing per command, for files nobody changed.

The record: one small JSON file per part under the memgas cache directory
(:func:`~memgas.pipeline.models.cache_dir.memgas_cache_dir` ``("verified")``, named by a hash of the part's
absolute path; outside the bank, so that a command that only reads a bank, ``memgas answer``, leaves its files
as they were), holding the path, the digest the bytes were found to have and the file's identity at that
moment: ``(size, mtime_ns, ctime_ns, inode, device)``. It is used only where all of these hold, checked on
every use:

- the record names this path, and the part's marker still records that digest (a part written again has a
  new marker and a new digest);
- the file is a regular file (symlinks followed) of the size its marker records;
- its ``stat`` equals the recorded identity, field by field.

Why that is safe: any write to a file moves its ctime to the time of the write, and a user cannot set ctime
back (``utime`` sets mtime and atime only, and sets ctime to now); a file replaced by a rename is another
inode. So a file whose identity is unchanged has not been written since it was hashed, **provided** the
write did not fall in the same timestamp tick as the ctime recorded. That is excluded when the record is
made (git's "racy" rule): only where the file's ctime is at least :data:`RACY_NS` older than the moment the
hash began, and the file's ``stat`` after the hash equals the one before it. A write after the record then
gives a ctime at least that much newer than the recorded one. What it does not catch: bytes changed on disk
without going through the file system (a failing disk, a raw write to the device), which changes neither
time; the hash of every read is still what detects a damaged file of another size or kind. The clock
compared with ctime is this machine's: a bank on a network file system whose server clock runs behind by
more than :data:`RACY_NS` should not rely on it (``MEMGAS_VERIFY_ALWAYS=1`` hashes every part on every use).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from pathlib import Path

from memgas.pipeline.bank_files import atomic_write_bytes
from memgas.pipeline.hashing import file_digest, read_regular_bytes
from memgas.pipeline.models.cache_dir import memgas_cache_dir

#: a file is recorded as verified only when its last change (ctime) is this much older than the start of the
#: hash that verified it: a write in the same timestamp tick as the recorded ctime is then impossible
RACY_NS = 2_000_000_000
#: the records' folder under the memgas cache directory (deleting it costs one hash per part, nothing else)
VERIFIED_DIR = "verified"
#: set to 1: every part is hashed on every use (no record is read or written)
ALWAYS_ENV = "MEMGAS_VERIFY_ALWAYS"


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def record_path(path: Path) -> Path:
    """Where the record of the part at ``path`` (made absolute) is kept."""
    name = hashlib.blake2b(str(Path(os.path.abspath(path))).encode("utf-8", "surrogatepass"), digest_size=16)
    return memgas_cache_dir(VERIFIED_DIR) / f"{name.hexdigest()}.json"


def verified_before(path: Path, digest: str, size: int | None) -> bool:
    """Whether the record of ``path`` says it was hashed to ``digest`` and the file has not changed since: a
    regular file of ``size`` bytes (when recorded) whose identity is the one recorded."""
    if os.environ.get(ALWAYS_ENV) == "1":
        return False
    try:
        st = os.stat(path)
        rec = json.loads(read_regular_bytes(record_path(path)))
    except (OSError, ValueError):
        return False
    if not stat.S_ISREG(st.st_mode) or (size is not None and st.st_size != size):
        return False
    return isinstance(rec, dict) and rec.get("path") == os.path.abspath(path) and rec.get("digest") == digest \
        and rec.get("identity") == _identity(st)


def hash_and_record(path: Path, digest: str, size: int | None) -> bool:
    """Hash ``path`` (:func:`file_digest`) and compare with ``digest``; on a match, record it when the file's
    identity was the same before and after the hash and its ctime is older than the hash's start by
    :data:`RACY_NS`. A record that cannot be written (a read-only bank) is skipped: the next use hashes."""
    try:
        before = os.stat(path)
        if not stat.S_ISREG(before.st_mode) or (size is not None and before.st_size != size):
            return False
        start = time.time_ns()
        ok = file_digest(path) == digest
        after = os.stat(path)
    except OSError:
        return False
    if ok and os.environ.get(ALWAYS_ENV) != "1" and _identity(before) == _identity(after) \
            and before.st_ctime_ns < start - RACY_NS:
        record = record_path(path)
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(record, json.dumps({"path": os.path.abspath(path), "digest": digest,
                                                   "identity": _identity(before)}).encode(),
                               point="bank:write-verified")
        except OSError:
            pass
    return ok


def forget(path: Path) -> None:
    """Drop the record of ``path`` (its part is dropped; a record left would never match another file, as
    its identity names this one's inode and times, but it would take space)."""
    record_path(path).unlink(missing_ok=True)
