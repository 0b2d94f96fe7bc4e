"""What an ingest and an append share: the arguments' checks, the format's detection, the chunk buffer of
rows and the dedup of texts, turns and pairs against what is written already.

Below :mod:`memgas.pipeline.ingest` and :mod:`memgas.pipeline.append` (which builds on these, and which the
ingest module re-exports).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow as pa

from memgas.pipeline.bank import INGEST_TABLES, MANIFEST
from memgas.pipeline.data import AUTO, FORMATS
from memgas.pipeline.data.common import HistoryRecord
from memgas.pipeline.errors import BankError, DataError, MemgasError
from memgas.pipeline.locks import LOCK
from memgas.pipeline.schema import schema_for

log = logging.getLogger(__name__)


class IngestInterrupted(KeyboardInterrupt):
    """SIGINT during ingest; ``message`` says what the bank holds now (the CLI prints it)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


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
    raise DataError(str(p), f"cannot tell the format; pass one of {list(FORMATS)}")


class _Chunk:
    """Rows of the histories buffered since the last flush (deduplicated against the whole file)."""

    def __init__(self) -> None:
        self.rows: dict[str, list[dict[str, Any]]] = {t: [] for t in INGEST_TABLES}
        self.histories = 0
        self.chars = 0

    def table(self, name: str) -> pa.Table:
        return pa.Table.from_pylist(self.rows[name], schema=schema_for(name))


def _check_args(p: Path, fmt: str, out: Path, limit: Any, chunk_histories: Any, chunk_chars: Any) -> str:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise MemgasError(f"limit must be a whole number >= 0 (or none for all), got {limit!r}")
    for name, v in (("chunk_histories", chunk_histories), ("chunk_chars", chunk_chars)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise MemgasError(f"{name} must be a whole number >= 1, got {v!r}")
    if not p.exists():
        raise DataError(str(p), "no such file")
    if not p.is_file():
        raise DataError(str(p), "not a regular file" + (" (a directory)" if p.is_dir() else ""))
    if fmt == AUTO:
        fmt = detect_format(p)
        log.debug("%s: detected format %s", p, fmt)
    if fmt not in FORMATS:
        raise DataError(str(p), f"unknown format {fmt!r}; expected one of {[*FORMATS, AUTO]}")
    _check_out(out)
    return fmt


def _check_out(out: Path) -> None:
    """``out`` is missing, empty (but for a lock file) or a bank: never write into a user's directory."""
    if out.exists():
        if not out.is_dir():
            raise BankError(f"{out}: exists and is not a directory (the bank to create or replace)")
        # another ingest creating this bank leaves its lock and, for an instant, the manifest's temp file
        # (``.manifest.json.*.tmp``) before the manifest: neither makes the directory a user's
        if not (out / MANIFEST).exists() and any(
                c.name != LOCK and not (c.name.startswith(f".{MANIFEST}.") and c.name.endswith(".tmp"))
                for c in out.iterdir()):
            raise BankError(f"{out}: a non-empty directory that is not a memory bank; choose a new or empty directory")


def _add_rows(rec: HistoryRecord, hrow: dict[str, Any], chunk: _Chunk, counts: dict[str, int],
              seen_texts: set[bytes], seen_sessions: set[bytes]) -> set[str]:
    """Buffer a record's history row, its session and question rows, and the texts, turns and pairs not
    written yet (an ingest's first sight of them, or an append's: the bank does not hold them); returns the
    session hashes first seen here."""
    rows = chunk.rows
    rows["histories"].append(hrow)
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
    return new_sessions
