"""Ingest a dataset file into a memory bank: stream records, deduplicate texts, write bounded chunks.

``ingest(path, fmt, bank_dir)`` reads one file with the loader of its format (records are streamed, never
the whole file), and writes the tables ``histories, sessions, texts, turns, pairs, queries`` as parts
``ingest-00000, ingest-00001, ...`` of a few histories each, so memory stays bounded by one chunk plus the
set of hashes already written. Texts, turns and pairs are written once per unique session/text across the
whole file (LongMemEval haystacks share most sessions between questions).

Re-ingesting into the same bank first drops every earlier ``ingest-*`` part, so it replaces, never
duplicates; the same file gives the same Parquet bytes. If the load fails (bad data), the parts written
so far are dropped again so the bank is never left half-ingested.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
from tqdm.auto import tqdm

from memgas.pipeline.bank import Bank
from memgas.pipeline.data import jsonl, locomo, longmemeval, longmtbench
from memgas.pipeline.data.common import HistoryRecord, Warnings
from memgas.pipeline.errors import DataError
from memgas.pipeline.hashing import file_sha256
from memgas.pipeline.schema import schema_for

log = logging.getLogger(__name__)

#: The tables this stage owns.
INGEST_TABLES: tuple[str, ...] = ("histories", "sessions", "texts", "turns", "pairs", "queries")
PART_PREFIX = "ingest-"

Loader = Callable[..., Iterator[HistoryRecord]]
LOADERS: dict[str, Loader] = {
    "longmemeval": longmemeval.load,
    "locomo": locomo.load,
    "longmtbench": longmtbench.load,
    "jsonl": jsonl.load,
}
FORMATS: tuple[str, ...] = (*LOADERS, "auto")


def detect_format(path: str | Path) -> str:
    """Guess the format from the extension and the first keys of the file (cheap: reads 64 KiB)."""
    p = Path(path)
    if p.suffix.lower() in (".jsonl", ".ndjson"):
        return "jsonl"
    try:
        with open(p, "rb") as f:
            head = f.read(1 << 16).decode("utf-8", "replace")
    except OSError as exc:
        raise DataError(str(p), f"cannot read: {exc.strerror}") from None
    body = head.lstrip("\ufeff \t\r\n")
    if body.startswith("{"):
        return "jsonl"
    for key, fmt in (
        ('"haystack_sessions"', "longmemeval"),
        ('"question_id"', "longmemeval"),
        ('"sample_id"', "locomo"),
        ('"conversation"', "locomo"),
        ('"conversation_id"', "longmtbench"),
    ):
        if key in head:
            return fmt
    raise DataError(str(p), f"cannot tell the format; pass one of {list(LOADERS)}")


class _Chunk:
    """Rows of the histories buffered since the last flush (deduplicated against the whole file)."""

    def __init__(self) -> None:
        self.rows: dict[str, list[dict[str, Any]]] = {t: [] for t in INGEST_TABLES}
        self.histories = 0
        self.chars = 0

    def table(self, name: str) -> pa.Table:
        return pa.Table.from_pylist(self.rows[name], schema=schema_for(name))


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
) -> dict[str, Any]:
    """Load ``path`` (format ``fmt``, or ``"auto"``) into the bank at ``bank_dir``; returns a summary.

    ``strict`` turns data warnings (empty sessions, unparseable dates, missing evidence, ...) into
    :class:`DataError`; ``limit`` keeps the first N histories. A chunk is flushed every
    ``chunk_histories`` histories or ``chunk_chars`` characters of new text, whichever comes first.
    """
    t0 = time.perf_counter()
    p = Path(path)
    if not p.is_file():
        raise DataError(str(p), "no such file")
    if fmt == "auto":
        fmt = detect_format(p)
        log.info("%s: detected format %s", p, fmt)
    if fmt not in LOADERS:
        raise DataError(str(p), f"unknown format {fmt!r}; expected one of {list(FORMATS)}")
    if limit is not None and limit < 0:
        raise ValueError("limit must be >= 0")

    bank = Bank.create(bank_dir)
    _drop_ingest_parts(bank)
    warnings = Warnings(str(p), strict=strict)
    size = p.stat().st_size
    bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"ingest {p.name}", disable=not progress, leave=False)

    seen_texts: set[bytes] = set()  # 16-byte digests: ~70 B per entry in a set, fine at 10^7 texts
    seen_sessions: set[bytes] = set()
    history_ids: set[str] = set()
    query_ids: set[str] = set()
    counts = {"histories": 0, "sessions": 0, "unique_sessions": 0, "texts": 0, "turns": 0, "pairs": 0, "queries": 0}
    parts: list[str] = []
    chunk = _Chunk()

    def flush() -> None:
        nonlocal chunk
        if chunk.histories == 0:
            return
        part = f"{PART_PREFIX}{len(parts):05d}"
        for name in INGEST_TABLES:
            bank.write_part(name, part, chunk.table(name), info={"source": str(p)})
        parts.append(part)
        log.debug("wrote %s (%d histories)", part, chunk.histories)
        chunk = _Chunk()

    try:
        for rec in LOADERS[fmt](p, warnings, on_read=bar.update):
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
    except BaseException:
        # never leave a half-ingested bank behind: a later stage would silently use part of a dataset
        bar.close()
        _drop_ingest_parts(bank)
        raise
    bar.close()

    dataset = {
        "path": str(p.resolve()),
        "format": fmt,
        "sha256": file_sha256(p),
        "bytes": size,
        "limit": limit,
        "strict": strict,
        "counts": dict(counts),
    }
    warn_summary = warnings.summary()
    summary: dict[str, Any] = {
        **dataset,
        **counts,
        "parts": len(parts),
        "warnings": warn_summary,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    bank.update_manifest(
        datasets=[dataset],
        stages={"ingest": {"parts": len(parts), "warnings": {k: v["count"] for k, v in warn_summary.items()}}},
    )
    log.info(
        "ingested %s: %d histories, %d sessions (%d unique), %d queries in %.1fs",
        p.name, counts["histories"], counts["sessions"], counts["unique_sessions"], counts["queries"], summary["seconds"],
    )
    return summary


def _add(
    rec: HistoryRecord,
    chunk: _Chunk,
    counts: dict[str, int],
    seen_texts: set[bytes],
    seen_sessions: set[bytes],
) -> None:
    rows = chunk.rows
    rows["histories"].append(rec.history_row())
    rows["sessions"].extend(rec.sessions)
    rows["queries"].extend(rec.queries)
    for h, text in rec.texts.items():
        key = bytes.fromhex(h)
        if key not in seen_texts:
            seen_texts.add(key)
            rows["texts"].append({"text_hash": h, "text": text})
            chunk.chars += len(text)
            counts["texts"] += 1
    new_sessions: set[str] = set()
    for s in rec.sessions:
        key = bytes.fromhex(s["text_hash"])
        if key not in seen_sessions:
            seen_sessions.add(key)
            new_sessions.add(s["text_hash"])
    # turns/pairs are keyed by the session hash: only the first history that holds a session writes
    # them, and a session repeated inside one history writes them once
    done: set[tuple[str, int]] = set()
    for t in rec.turns:
        k = (t["session_hash"], t["turn_index"])
        if t["session_hash"] in new_sessions and k not in done:
            done.add(k)
            rows["turns"].append(t)
            chunk.chars += len(t["content"])
            counts["turns"] += 1
    done.clear()
    for pr in rec.pairs:
        k = (pr["session_hash"], pr["pair_index"])
        if pr["session_hash"] in new_sessions and k not in done:
            done.add(k)
            rows["pairs"].append(pr)
            counts["pairs"] += 1
    chunk.histories += 1
    counts["histories"] += 1
    counts["sessions"] += len(rec.sessions)
    counts["unique_sessions"] += len(new_sessions)
    counts["queries"] += len(rec.queries)


def _drop_ingest_parts(bank: Bank) -> None:
    for name in INGEST_TABLES:
        for part in bank.parts(name):
            if part.startswith(PART_PREFIX):
                bank.drop_part(name, part)
        # unmarked leftovers of a killed run are ignored by readers but would linger on disk
        d = bank.path / name
        if d.is_dir():
            for f in d.glob(f"{PART_PREFIX}*.parquet"):
                f.unlink(missing_ok=True)
