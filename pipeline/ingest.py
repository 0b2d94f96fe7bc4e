"""Ingest a dataset file into a memory bank: stream records, deduplicate texts, write bounded chunks.

``ingest(path, fmt, bank_dir)`` reads one file with the loader of its format (records are streamed, never
the whole file), and writes the tables ``histories, sessions, texts, turns, pairs, queries`` as parts
``ingest-<slot>-00000, ...`` of a few histories each, so memory stays bounded by one chunk plus the set of
hashes already written. Texts, turns and pairs are written once per unique session/text across the whole
file (LongMemEval haystacks share most sessions between questions).

Re-ingesting never destroys a bank (docs/reliability.md): the new parts are written beside the committed
ones, invisible to readers, and become the bank's dataset by one atomic manifest write at the very end,
after the whole file was read and validated; then the previous ingest's parts are dropped. A bad file, an
interrupt (SIGINT), a kill or a full disk before that commit leave the bank exactly as it was; the
caches (generations, embeddings, edges, derived texts) are never touched. The same file gives the same
Parquet bytes (the part names alternate between two slots).

Appending a file to a bank (``append``, re-exported here) is in :mod:`memgas.pipeline.append`; the chunk
buffer, row dedup and argument checks both share are in :mod:`memgas.pipeline.ingest_rows`.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from memgas.pipeline import faults
from memgas.pipeline.append import append
from memgas.pipeline.bank import INGEST_PREFIX, INGEST_TABLES, MANIFEST, Bank
from memgas.pipeline.data import FORMATS, loader
from memgas.pipeline.data.common import HistoryRecord, Warnings
from memgas.pipeline.dataset_history import APPEND_KIND
from memgas.pipeline.errors import BankError, DataError
from memgas.pipeline.hashing import file_sha256
from memgas.pipeline.ingest_rows import (
    IngestInterrupted,
    _add_rows,
    _check_args,
    _check_out,
    _Chunk,
    detect_format,
)
from memgas.pipeline.locks import LOCK, locked

log = logging.getLogger(__name__)

__all__ = ["APPEND_KIND", "INGEST_TABLES", "FORMATS", "IngestInterrupted", "append", "detect_format", "ingest",
           "is_current"]

PART_PREFIX = INGEST_PREFIX

Loader = Callable[..., Iterator[HistoryRecord]]


def is_current(bank_dir: str | Path, path: str | Path, fmt: str, limit: int | None = None) -> bool:
    """Whether the bank at ``bank_dir`` holds exactly this file (sha256, format, limit), intact.

    False for a missing or damaged bank (a committed ingest part deleted): the caller re-ingests.
    """
    try:
        bank = Bank(bank_dir)
        # the base dataset: the last entry that is not an append (appends come after it)
        ds = ([d for d in bank.manifest.get("datasets") or [] if d.get("kind") != APPEND_KIND] or [{}])[-1]
    except BankError:
        return False
    want = {"sha256": file_sha256(path), "format": fmt, "limit": limit}
    return all(ds.get(k) == v for k, v in want.items()) and not bank.damaged_ingest_parts() and bank.exists("sessions")


def _make_dir(out: Path) -> bool:
    """Create ``out`` (and its parents); whether this call created ``out`` itself (then a failed first
    ingest may remove it again; a directory that was there before is left as it was found)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        out.mkdir()
    except FileExistsError:
        return False
    return True


def ingest(
    path: str | Path,
    fmt: str,
    bank_dir: str | Path,
    *,
    strict: bool = False,
    limit: int | None = None,
    progress: bool = True,
    chunk_histories: int = 500,
    chunk_chars: int = 16 << 20,
    lock: bool = True,
    replace: bool = False,
) -> dict[str, Any]:
    """Load ``path`` (format ``fmt``, or ``"auto"``) into the bank at ``bank_dir``; returns a summary.

    ``strict`` turns data warnings (empty sessions, unparseable dates, missing evidence, repeated
    sessions, ...) into :class:`DataError`; ``limit`` keeps the first N histories. A chunk is flushed every
    ``chunk_histories`` histories or ``chunk_chars`` characters of new text, whichever comes first.

    The bank's lock (:func:`memgas.pipeline.locks.locked`, the one ``memgas run`` takes) is held from
    before the first write to the end, so two ingests into one bank cannot interleave, and the cleanup of
    a failed first ingest can only ever remove what this call wrote. ``lock=False``: the caller holds it.
``replace``: a bank whose manifest cannot be read (a FIFO, a symlink to a device, not JSON) is started
over with a new manifest (``memgas ingest --replace``); without it such a bank is refused.

    Fault points: ``ingest:after-part`` (each staged part written), then the commit's
    (:meth:`Bank.commit_ingest`): ``ingest:before-commit``, ``ingest:after-commit``.
    """
    t0 = time.perf_counter()
    p = Path(path)
    out = Path(bank_dir)
    fmt = _check_args(p, fmt, out, limit, chunk_histories, chunk_chars)
    if not lock:
        return _ingest(p, fmt, out, made=False, own_lock=False, strict=strict, limit=limit, progress=progress,
                       chunk_histories=chunk_histories, chunk_chars=chunk_chars, t0=t0, replace=replace)
    made = _make_dir(out)
    with locked(out):
        return _ingest(p, fmt, out, made=made, own_lock=True, strict=strict, limit=limit, progress=progress,
                       chunk_histories=chunk_histories, chunk_chars=chunk_chars, t0=t0, replace=replace)


def _ingest(p: Path, fmt: str, out: Path, *, made: bool, own_lock: bool, strict: bool, limit: int | None,
            progress: bool, chunk_histories: int, chunk_chars: int, t0: float, replace: bool) -> dict[str, Any]:
    """The ingest proper, under the bank's lock. ``made``: this call created ``out``."""
    _check_out(out)  # again under the lock: another ingest may have written into it since the first check
    # decided under the lock, from what is there (not from whether the directory existed a moment ago:
    # another ingest may have created it and committed its bank in between)
    created = not (out / MANIFEST).exists()
    bank = Bank.create(out, replace=replace)
    try:
        slot = bank.begin_ingest()
    except BaseException:
        if created:
            _remove_new_bank(out, made, own_lock)
        raise
    warnings = Warnings(str(p), strict=strict)
    size = p.stat().st_size
    bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"ingest {p.name}", disable=None if progress else True, leave=False)  # None: only on a terminal

    seen_texts: set[bytes] = set()  # 16-byte digests: ~70 B per entry in a set, fine at 10^7 texts
    seen_sessions: set[bytes] = set()
    history_ids: set[str] = set()
    query_ids: set[str] = set()
    counts = {"histories": 0, "sessions": 0, "unique_sessions": 0, "repeated_sessions": 0, "texts": 0, "turns": 0,
              "pairs": 0, "queries": 0}
    parts: list[str] = []
    chunk = _Chunk()
    dataset: dict[str, Any] = {}

    def flush() -> None:
        nonlocal chunk
        if chunk.histories == 0:
            return
        part = f"{PART_PREFIX}{slot}-{len(parts):05d}"
        for name in INGEST_TABLES:
            bank.write_part(name, part, chunk.table(name), info={"source": str(p)})
        parts.append(part)
        faults.hit("ingest:after-part")
        log.debug("wrote %s (%d histories)", part, chunk.histories)
        chunk = _Chunk()

    def committed() -> bool:
        """Whether the manifest names this ingest (the commit is one atomic write: it did or it did not)."""
        try:
            m = bank.manifest
        except BankError:
            return False
        return bool(dataset) and (m.get("ingest") or {}).get("parts") == parts and (m.get("datasets") or [{}])[-1] == dataset

    try:
        try:
            for rec in loader(fmt)(p, warnings, on_read=bar.update):
                if limit is not None and counts["histories"] >= limit:
                    break
                if rec.history_id in history_ids:
                    raise DataError(str(p), f"duplicate history id {rec.history_id!r}", index=rec.index, record_id=rec.history_id)
                history_ids.add(rec.history_id)
                for q in rec.queries:
                    if q["query_id"] in query_ids:
                        raise DataError(str(p), f"duplicate question id {q['query_id']!r}", index=rec.index, record_id=rec.history_id)
                    query_ids.add(q["query_id"])
                _add(rec, chunk, counts, seen_texts, seen_sessions)
                if chunk.histories >= chunk_histories or chunk.chars >= chunk_chars:
                    flush()
            flush()
        finally:
            bar.close()
        warn_summary = warnings.summary()
        notes = warnings.notes()
        dataset = {
            "path": str(p.resolve()),
            "format": fmt,
            "sha256": file_sha256(p),
            "bytes": size,
            "limit": limit,
            "strict": strict,
            "counts": dict(counts),
            "warnings": warnings.total,
        }
        # the commit: one atomic manifest write; from then on the bank holds the new dataset
        bank.commit_ingest(
            parts,
            datasets=[dataset],
            stages={"ingest": {"parts": len(parts), "warnings": {k: v["count"] for k, v in warn_summary.items()},
                               "notes": {k: v["count"] for k, v in notes.items()}}},
        )
    except KeyboardInterrupt:
        if committed():
            raise IngestInterrupted(f"interrupted after the new data was committed: {out} holds {p.name}") from None
        _abort(bank, out, created, made, own_lock)
        raise IngestInterrupted(f"interrupted before the new data was committed: {out} is unchanged") from None
    except BaseException:
        # never leave a half-ingested bank behind: the committed data stays as it was
        if not committed():
            _abort(bank, out, created, made, own_lock)
        raise

    summary: dict[str, Any] = {
        **dataset,
        **counts,
        "parts": len(parts),
        "warnings": warn_summary,
        "warning_count": warnings.total,
        "notes": notes,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    log.info(
        "ingested %s: %d histories, %d sessions (%d unique, %d repeats dropped), %d queries, %d warnings in %.1fs",
        p.name, counts["histories"], counts["sessions"], counts["unique_sessions"], counts["repeated_sessions"],
        counts["queries"], warnings.total, summary["seconds"],
    )
    return summary


def _abort(bank: Bank, out: Path, created: bool, made: bool, own_lock: bool) -> None:
    try:
        if created:
            _remove_new_bank(out, made, own_lock)
        else:
            bank.abort_ingest()
    except OSError as exc:  # e.g. the disk went away: the staged parts stay invisible, the next ingest drops them
        log.warning("could not remove the staged ingest parts in %s: %s", out, exc)


def _remove_new_bank(out: Path, made: bool, own_lock: bool) -> None:
    """Undo a first ingest that failed, under the lock: everything in ``out`` was written by this call
    (there was no manifest when the lock was taken, and nothing but the lock file), so remove it; the lock
    file last and only if this call holds it (a caller's lock must outlive us); ``out`` itself only if this
    call created it and nobody started writing into it since (rmdir fails on a non-empty directory)."""
    for child in out.iterdir():
        if child.name == LOCK:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
    if own_lock:
        (out / LOCK).unlink(missing_ok=True)  # a process waiting on it sees the inode gone and refuses
        if made:
            try:
                out.rmdir()
            except OSError:
                pass


def _add(
    rec: HistoryRecord,
    chunk: _Chunk,
    counts: dict[str, int],
    seen_texts: set[bytes],
    seen_sessions: set[bytes],
) -> None:
    new_sessions = _add_rows(rec, rec.history_row(), chunk, counts, seen_texts, seen_sessions)
    chunk.histories += 1
    counts["repeated_sessions"] += len(rec.repeats)
    counts["histories"] += 1
    counts["sessions"] += len(rec.sessions)
    counts["unique_sessions"] += len(new_sessions)
    counts["queries"] += len(rec.queries)
