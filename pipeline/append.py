"""Append a dataset file to an existing memory bank (``memgas ingest --append``): new sessions of known
histories, new histories and new questions, committed atomically as new ingest parts beside the old ones.

Importable from :mod:`memgas.pipeline.ingest` too (``from memgas.pipeline.ingest import append``); the chunk
buffer and row dedup an append shares with an ingest are in :mod:`memgas.pipeline.ingest_rows`.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from pathlib import Path
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memgas.pipeline import faults
from memgas.pipeline.bank import INGEST_PREFIX, INGEST_TABLES, MANIFEST, Bank, key_order
from memgas.pipeline.data import loader
from memgas.pipeline.data.common import HistoryRecord, Warnings
from memgas.pipeline.dataset_history import (
    APPEND_KIND,
    appends_of,
    dataset_digest,
    ingest_history,
    rebuild_commands_of,
)
from memgas.pipeline.errors import BankError, DataError
from memgas.pipeline.hashing import DigestSink, file_sha256
from memgas.pipeline.ingest_rows import IngestInterrupted, _add_rows, _check_args, _Chunk
from memgas.pipeline.locks import locked
from memgas.pipeline.schema import KEYS, schema_for

log = logging.getLogger(__name__)

__all__ = ["APPEND_KIND", "APPEND_TAG", "append", "appended_files", "content_digest", "dataset_digest",
           "dataset_identity", "ingest_history", "rebuild_commands"]

#: append parts: ``ingest-<slot>-x<NNNN>-<nnnnn>``, in the committed slot, named after every base part
APPEND_TAG = "x"


class _BankState:
    """What an append must know of the committed data: ids, session order and dates, text hashes.

    Held as Arrow columns, and turned into Python objects only for the records of the file (a history's
    sessions when a record names it, the hashes a batch of records brings): building sets and dicts of the
    whole bank took most of an append of 1,000 sessions to a 10^6-session history (~6 M text hashes)."""

    def __init__(self, bank: Bank) -> None:
        h = bank.read("histories")
        self.histories = {r["history_id"]: r for r in h.to_pylist()}
        self.queries = {r["query_id"]: r for r in bank.read("queries").to_pylist()}
        s = bank.read("sessions").sort_by([("history_id", "ascending"), ("position", "ascending")])
        self._sessions = s
        # each history's rows [start, stop) of the sorted table: its runs of equal history ids
        hid = s["history_id"]
        starts = [0, *(np.flatnonzero(pc.not_equal(hid.slice(1), hid.slice(0, len(hid) - 1)).to_numpy(
            zero_copy_only=False)) + 1).tolist()] if len(hid) else []
        stops = [*starts[1:], len(hid)]
        names = hid.take(pa.array(starts, pa.int64())).to_pylist() if starts else []
        self._span = {n: (a, b) for n, a, b in zip(names, starts, stops)}
        self.session_ids = _SessionIds(self)
        # hashes are read without de-duplication (a hash is held if any committed part holds it)
        self._held: dict[str, pa.Array] = {
            "texts": bank.read("texts", ["text_hash"], dedupe=False)["text_hash"].combine_chunks(),
            "sessions": pc.unique(pa.concat_arrays([
                bank.read(t, ["session_hash"], dedupe=False)["session_hash"].combine_chunks()
                for t in ("turns", "pairs")])),
        }

    def load_marks(self, bank: Bank, hashes: set[str]) -> None:
        """Read the stored evidence marks (``has_answer``, ``dia_id`` of each turn) of the sessions ``hashes``
        (a batch's sessions that the bank holds), for :meth:`marks`: one pass over ``turns`` per batch."""
        self._marks: dict[str, list[tuple[int, bool | None, str | None]]] = {}
        if not hashes:
            return
        t = bank.read("turns", ["session_hash", "turn_index", "has_answer", "dia_id"], batch_rows=1 << 16,
                      filter=pc.field("session_hash").isin(pa.array(sorted(hashes), pa.string())))
        for h, i, mark, dia in zip(*(t[c].to_pylist() for c in t.column_names)):
            self._marks.setdefault(h, []).append((i, mark, dia))

    def marks(self, session_hash: str) -> list[tuple[int, bool | None, str | None]]:
        """``(turn index, has_answer, dia_id)`` of a stored session's turns, in turn order."""
        return sorted(set(self._marks.get(session_hash, [])))

    def sessions_of(self, history_id: str) -> pa.Table | None:
        """The committed sessions of a history in position order (None: it has none)."""
        span = self._span.get(history_id)
        return None if span is None else self._sessions.slice(span[0], span[1] - span[0])

    def held(self, kind: str, hashes: set[str]) -> set[bytes]:
        """Of ``hashes`` (hex), those the bank holds (``kind``: "texts", or "sessions": sessions whose turns
        and pairs are written), as bytes: one pass over the bank's column for a batch of records."""
        if not hashes:
            return set()
        col = self._held[kind]
        found = col.filter(pc.is_in(col, value_set=pa.array(sorted(hashes), pa.string())))
        return {bytes.fromhex(x) for x in pc.unique(found).to_pylist()}


class _SessionIds(Mapping[str, set[str]]):
    """``history id -> its committed session ids``, built for the histories asked for (the loaders ask
    per record, to check the evidence of a question that names an old session)."""

    def __init__(self, state: _BankState) -> None:
        self.state = state
        self._last: tuple[str, set[str]] | None = None

    def __getitem__(self, history_id: str) -> set[str]:
        if self._last is None or self._last[0] != history_id:
            t = self.state.sessions_of(history_id)
            if t is None:
                raise KeyError(history_id)
            self._last = (history_id, set(t["session_id"].to_pylist()))
        return self._last[1]

    def __contains__(self, history_id: object) -> bool:
        return history_id in self.state._span

    def __iter__(self) -> Iterator[str]:
        return iter(self.state._span)

    def __len__(self) -> int:
        return len(self.state._span)


def _batches(records: Iterable[HistoryRecord], max_records: int, max_chars: int) -> Iterator[list[HistoryRecord]]:
    """Records in batches of at most ``max_records`` or about ``max_chars`` characters of text: the bank's
    hashes are looked up once per batch."""
    batch: list[HistoryRecord] = []
    chars = 0
    for rec in records:
        batch.append(rec)
        chars += sum(len(t) for t in rec.texts.values())
        if len(batch) >= max_records or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _same_row(name: str, a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Rows equal once both are cast to the table's schema (the bank's types, not the loader's)."""
    t = pa.Table.from_pylist([a, b], schema=schema_for(name)).to_pylist()
    return t[0] == t[1]


def _same_session(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """A session re-sent under a known id is the stored one when every field but its place (history,
    position: a file may hold only what is new) is equal: text, date as given and parsed, turns. Another
    date would silently keep the old one, so it is "other content" like changed text."""
    place = {"history_id": "", "position": 0}
    return _same_row("sessions", {**old, **place}, {**new, **place})


def _same_marks(rec: HistoryRecord, old: pa.Table, state: _BankState, path: Path) -> None:
    """A session re-sent under a known id of its history carries the evidence marks stored with it
    (``has_answer`` and ``dia_id`` of every turn): other marks would be dropped silently, since the turns of
    a stored session are never written again, so they are "other content" like changed text."""
    stored = dict(zip(old["session_id"].to_pylist(), old["text_hash"].to_pylist()))
    for s in rec.sessions:
        if stored.get(s["session_id"]) != s["text_hash"]:  # new, or other text (refused by _merge_history)
            continue
        sent = sorted({(t["turn_index"], t["has_answer"], t["dia_id"]) for t in rec.turns
                       if t["session_hash"] == s["text_hash"]})
        if sent != state.marks(s["text_hash"]):
            raise DataError(str(path), f"session {s['session_id']!r} is already in history {rec.history_id!r} "
                            "with other has_answer or dia_id marks on its turns (an append adds sessions, it "
                            "never changes one)", index=rec.index, record_id=rec.history_id)


def _merge_history(rec: HistoryRecord, old: pa.Table, allow_reorder: bool, path: Path
                   ) -> tuple[list[dict[str, Any]], int | None]:
    """The session rows an append writes for an existing history (``old``: its committed sessions in
    position order), and the first position whose rows must be recomputed (None: only new positions).
    Sessions already there (same id, same text) are skipped; a changed one (text, date, any field) is an
    error; new ones go after the last one, or, dated before it and with ``allow_reorder``, into date order
    (the positions after the insertion point shift)."""
    ids = pa.array([s["session_id"] for s in rec.sessions], pa.string())
    have = {r["session_id"]: r for r in old.filter(pc.is_in(old["session_id"], value_set=ids)).to_pylist()}
    new = []
    for s in rec.sessions:
        o = have.get(s["session_id"])
        if o is None:
            new.append(dict(s))
        elif not _same_session(o, s):
            raise DataError(str(path), f"session {s['session_id']!r} is already in history {rec.history_id!r} "
                            "with other content (an append adds sessions, it never changes one)",
                            index=rec.index, record_id=rec.history_id)
    if not new:
        return [], None
    # the last *dated* one: an undated session appended earlier must not switch the check off
    dated = np.flatnonzero(old["date"].is_valid().to_numpy(zero_copy_only=False))
    last = old.slice(int(dated[-1]) if dated.size else old.num_rows - 1, 1).to_pylist()[0]
    early = [s for s in new if s["date"] is not None and last["date"] is not None and s["date"] < last["date"]]
    if early and not allow_reorder:
        s = early[0]
        raise DataError(str(path), f"session {s['session_id']!r} ({s['date_raw']}) is dated before the last session "
                        f"{last['session_id']!r} ({last['date_raw']}) of history {rec.history_id!r}; an append adds "
                        "sessions at the end (--allow-reorder inserts it in date order and recomputes from there)",
                        index=rec.index, record_id=rec.history_id)
    if not early:  # after the old ones: only the new rows are written
        for i, r in enumerate(new, start=old.num_rows):
            r["history_id"] = rec.history_id
            r["position"] = i
        return new, None
    order = old.to_pylist()  # a reordered history: its rows from the insertion point on are written again
    cut = len(order)
    for s in new:
        at = len(order)
        if s in early:  # before the first kept session dated after it
            at = next(i for i, o in enumerate(order) if o["date"] is not None and o["date"] > s["date"])
            cut = min(cut, at)
        order.insert(at, s)
    for i, r in enumerate(order):
        r["history_id"] = rec.history_id
        r["position"] = i
    out = [r for i, r in enumerate(order) if i >= cut]  # new rows, and old rows whose position moved
    return out, (cut if cut < old.num_rows else None)


def append(
    path: str | Path,
    fmt: str,
    bank_dir: str | Path,
    *,
    strict: bool = False,
    allow_reorder: bool = False,
    progress: bool = True,
    chunk_histories: int = 500,
    chunk_chars: int = 16 << 20,
) -> dict[str, Any]:
    """Add the sessions and questions of ``path`` to the bank at ``bank_dir`` (``memgas ingest --append``).

    A record whose history id is in the bank adds its new sessions after the existing ones (sessions it
    repeats, same id and same text, are skipped, so a file can hold whole histories or only what is new)
    and its new questions; other records add new histories. Appending the same file twice changes
    nothing. A new session dated before its history's last session is a :class:`DataError` unless
    ``allow_reorder``: then it is inserted in date order and the manifest entry names, per history, the
    first position whose association rows must be recomputed (``recompute_from``).

    Atomicity (why new parts instead of a rewritten slot): the rows are written as new ingest parts
    ``ingest-<slot>-x<NNNN>-*`` beside the committed ones and committed together by one atomic manifest
    write that names old and new parts (:meth:`Bank.commit_ingest`), so an append costs what it adds, not
    the bank, and a bad file, an interrupt or a kill before that write leaves the bank as it was (the next
    ingest or append drops the uncommitted parts). Readers merge parts by key, later parts winning: that
    is how a history's ``n_sessions`` and moved positions are updated. The manifest's ``datasets`` list
    gets one entry per append (``"kind": "append"``, the file, its counts, the histories extended and
    the first new position of each), which later stages read to know what changed.
    """
    t0 = time.perf_counter()
    p = Path(path)
    out = Path(bank_dir)
    fmt = _check_args(p, fmt, out, None, chunk_histories, chunk_chars)
    if not (out / MANIFEST).exists():
        raise BankError(f"{out}: no memory bank to append to; create it with `memgas ingest FILE --out {out}`")
    with locked(out):
        bank = Bank(out)
        if not bank.exists("sessions"):
            raise BankError(f"{out}: the bank has no complete ingested dataset to append to; run `memgas ingest` first")
        bank.abort_ingest()  # parts of a killed ingest or append: never committed, dropped
        committed = sorted(bank.ingest_parts() or [])
        slot = committed[0][len(INGEST_PREFIX)] if committed else "a"
        n_app = 1 + sum(1 for d in bank.manifest.get("datasets") or [] if d.get("kind") == APPEND_KIND)
        prefix = f"{INGEST_PREFIX}{slot}-{APPEND_TAG}{n_app:04d}-"
        state = _BankState(bank)
        warnings = Warnings(str(p), strict=strict,  # a new question's evidence may be an old session
                            known_sessions=state.session_ids)
        counts = {"histories": 0, "histories_extended": 0, "sessions": 0, "texts": 0, "turns": 0, "pairs": 0,
                  "queries": 0}
        extended: dict[str, int] = {}  # history id -> first new position
        recompute: dict[str, int] = {}
        parts: list[str] = []
        chunk = _Chunk()
        seen_ids: set[str] = set()
        seen_texts: set[bytes] = set()  # the bank's hashes a batch brings, and those written since
        seen_sessions: set[bytes] = set()
        new_queries: set[str] = set()
        n_records = 0

        def flush() -> None:
            nonlocal chunk
            if chunk.histories == 0:
                return
            part = f"{prefix}{len(parts):05d}"
            for name in INGEST_TABLES:
                bank.write_part(name, part, chunk.table(name), info={"source": str(p), "append": n_app})
            parts.append(part)
            faults.hit("ingest:after-part")
            chunk = _Chunk()

        try:
            def records() -> Iterator[HistoryRecord]:
                for batch in _batches(loader(fmt)(p, warnings), chunk_histories, chunk_chars):
                    seen_texts.update(state.held("texts", {h for r in batch for h in r.texts}))
                    held = state.held("sessions", {s["text_hash"] for r in batch for s in r.sessions})
                    seen_sessions.update(held)
                    state.load_marks(bank, {h.hex() for h in held})
                    yield from batch

            for rec in records():
                n_records += 1
                if rec.history_id in seen_ids:
                    raise DataError(str(p), f"duplicate history id {rec.history_id!r}", index=rec.index, record_id=rec.history_id)
                seen_ids.add(rec.history_id)
                queries = []
                for q in rec.queries:
                    o = state.queries.get(q["query_id"])
                    if q["query_id"] in new_queries:
                        raise DataError(str(p), f"duplicate question id {q['query_id']!r}", index=rec.index, record_id=rec.history_id)
                    if o is None:
                        queries.append(q)
                        new_queries.add(q["query_id"])
                    elif not _same_row("queries", o, q):
                        raise DataError(str(p), f"question {q['query_id']!r} is already in the bank with other content",
                                        index=rec.index, record_id=rec.history_id)
                old = state.sessions_of(rec.history_id)
                if old is None:
                    sessions, from_pos = list(rec.sessions), None
                    hrow = rec.history_row()
                else:
                    _same_marks(rec, old, state, p)
                    sessions, from_pos = _merge_history(rec, old, allow_reorder, p)
                    hrow = dict(state.histories[rec.history_id])
                n_old = 0 if old is None else pc.count_distinct(old["session_id"]).as_py()
                n_new = len(sessions) if old is None else int(pc.sum(pc.invert(pc.is_in(
                    pa.array([s["session_id"] for s in sessions], pa.string()), value_set=old["session_id"].combine_chunks()))).as_py() or 0)
                hrow["n_sessions"] = n_old + n_new
                if not sessions and not queries:
                    continue
                rec.sessions = sessions
                rec.queries = queries
                _append_rows(rec, hrow, n_new, chunk, counts, seen_texts, seen_sessions)
                if old is not None and n_new:
                    counts["histories_extended"] += 1
                    extended[rec.history_id] = old.num_rows if from_pos is None else from_pos
                    if from_pos is not None:
                        recompute[rec.history_id] = from_pos
                elif old is None:
                    counts["histories"] += 1
                if chunk.histories >= chunk_histories or chunk.chars >= chunk_chars:
                    flush()
            flush()
            if not parts:
                log.info("append %s: nothing new (%s)", p.name, "every session and question is in the bank already"
                         if n_records else "the file holds no history record")
                return {"path": str(p.resolve()), "format": fmt, "kind": APPEND_KIND, "counts": counts, "records": n_records,
                        "committed": False, "parts": 0, "warning_count": warnings.total,
                        "warnings": warnings.summary(), "seconds": round(time.perf_counter() - t0, 3)}
            entry = {
                "kind": APPEND_KIND,
                "path": str(p.resolve()),
                "format": fmt,
                "sha256": file_sha256(p),
                "bytes": p.stat().st_size,
                "strict": strict,
                "allow_reorder": allow_reorder,
                "counts": dict(counts),
                "warnings": warnings.total,
                "parts": list(parts),
                "sessions_from": extended,  # history -> first position added (or moved)
                "recompute_from": recompute,  # history -> first position whose rows must be recomputed
            }
            bank.commit_ingest(committed + parts, datasets=[*(bank.manifest.get("datasets") or []), entry])
        except BaseException:
            m = bank.manifest
            if not parts or not set(parts) <= set((m.get("ingest") or {}).get("parts") or []):
                bank.abort_ingest()  # the committed data stays as it was
            if isinstance(sys.exc_info()[1], KeyboardInterrupt):
                raise IngestInterrupted(f"interrupted before the append was committed: {out} is unchanged") from None
            raise
    summary = {**entry, "committed": True, "warning_count": warnings.total, "warnings": warnings.summary(),
               "seconds": round(time.perf_counter() - t0, 3)}
    log.info("appended %s: %d new histories, %d extended, %d sessions, %d questions in %.1fs", p.name,
             counts["histories"], counts["histories_extended"], counts["sessions"], counts["queries"], summary["seconds"])
    return summary


# -- the bank's data: one ingest and the appends after it (memgas.pipeline.dataset_history) ----------------
def appended_files(bank: Bank) -> list[dict[str, Any]]:
    """The appends in the bank's ingest history (empty for a bank ingested from one file)."""
    return appends_of(bank.manifest.get("datasets") or [])


#: the rows that make a bank's data, whatever files it came in (a table's rows by key, these columns; a
#: session's text and its turns' texts are in its ``text_hash``): what :func:`content_digest` digests
CONTENT_COLUMNS: dict[str, list[str] | None] = {
    "histories": None, "sessions": None, "queries": None,
    "turns": ["session_hash", "turn_index", "has_answer", "dia_id"],  # the evidence marks, not in the text
}


def content_digest(bank: Bank) -> str:
    """sha256 of the bank's ingested rows (:data:`CONTENT_COLUMNS`), each table read by key (later parts
    win, as every reader sees them) in key order: the same for the same data however it was split into an
    ingest and appends, or ordered in its files. Reads the key and mark columns, not the texts."""
    h = hashlib.sha256()
    for name, columns in CONTENT_COLUMNS.items():
        t = key_order(name, bank.read(name, columns)).combine_chunks()
        t = t.take(pa.array(range(t.num_rows), pa.int64()))  # one fresh chunk at offset 0: bytes follow the rows
        sink = DigestSink()
        with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), t.schema) as writer:
            for batch in t.to_batches():
                writer.write_batch(batch)
        h.update(f"{name} {sink.hexdigest()}\n".encode())
    return h.hexdigest()


def dataset_identity(bank: Bank) -> dict[str, Any]:
    """What a run names as its dataset (metrics.json / manifest.json ``dataset``, the fingerprints' dataset
    digest). A bank ingested from one file: that file's entry (``sha256`` is the file's). A grown bank: its
    whole ingest history, so that two runs over the same history compare as the same data and a run over
    another base file with the same append does not: ``sha256`` digests every entry's identity fields in
    order (paths left out), ``appends`` lists the appended files and ``counts`` are the bank's rows (what
    was evaluated), not the last file's. Either way ``content_sha256`` (:func:`content_digest`) is the data
    itself, by which `memgas report A B` compares runs: the same data split otherwise into appends (or
    ingested as one file) is the same."""
    history = ingest_history(bank.manifest.get("datasets") or [])
    if len(history) <= 1:
        return {**history[0], "content_sha256": content_digest(bank)} if history else {}
    base = history[0]
    return {"path": base.get("path"), "format": base.get("format"), "limit": base.get("limit"),
            "strict": base.get("strict"), "sha256": dataset_digest(history), "identity": "ingest history",
            "content_sha256": content_digest(bank),
            "appends": [{k: d.get(k) for k in ("path", "sha256", "format", "strict", "allow_reorder", "counts")}
                        for d in history[1:]],
            # rows by key: an append rewrites the rows of the histories it extends (later parts win)
            "counts": {t: bank.read(t, list(KEYS[t])).num_rows for t in ("histories", "sessions", "queries")}}


def rebuild_commands(bank: Bank) -> str:
    """The commands that build the bank's data again from its files (:func:`rebuild_commands_of`)."""
    return rebuild_commands_of(bank.manifest.get("datasets") or [], bank.path)


def _append_rows(rec: HistoryRecord, hrow: dict[str, Any], n_new: int, chunk: _Chunk, counts: dict[str, int],
                 seen_texts: set[bytes], seen_sessions: set[bytes]) -> None:
    """Like ingest's :func:`_add` for an append: the history row, the session rows given (new and moved), and the
    texts, turns and pairs the bank does not hold yet."""
    _add_rows(rec, hrow, chunk, counts, seen_texts, seen_sessions)
    chunk.histories += 1
    counts["sessions"] += n_new
    counts["queries"] += len(rec.queries)
