"""What every loader shares: the canonical record, rendering, date parsing, warnings and safe JSON streaming.

A loader turns one dataset file into a stream of :class:`HistoryRecord` (one user's memory with its
questions). The rows it holds already follow :mod:`memgas.pipeline.schema`; :func:`memgas.pipeline.ingest.ingest`
only deduplicates them and writes them to a bank in bounded chunks.

Rendering follows the MemGAS authors' preprocessing (``data/dataprocess.py`` of their repository): an
utterance is ``"[role]: content"``, a retrieval "turn" (pair) is two consecutive utterances joined by
``"\\n"`` (an odd last utterance is a pair by itself), and a session text is its pairs joined by ``"\\n"``.
"""

from __future__ import annotations

import codecs
import io
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any, Callable

import ijson

from memgas.pipeline.errors import DataError
from memgas.pipeline.hashing import text_hash

log = logging.getLogger(__name__)

#: How many examples of each warning kind are logged and kept in the ingest summary.
MAX_EXAMPLES = 5


# --------------------------------------------------------------------------------------------------
# canonical record
# --------------------------------------------------------------------------------------------------
@dataclass
class Utterance:
    """One utterance as given by the dataset (before rendering)."""

    role: str
    content: str
    has_answer: bool | None = None
    dia_id: str | None = None


def no_text(utterances: list[Utterance]) -> bool:
    """Whether a session has nothing to embed or retrieve: no turns, or only blank ones (such a session was
    kept as an empty text, embedded and ranked, without a word)."""
    return not any(u.content.strip() for u in utterances)


@dataclass
class HistoryRecord:
    """All rows of one history, one list per bank table (rows are dicts keyed by schema column)."""

    history_id: str
    dataset: str
    index: int = -1  # position of the record in its file (for error messages)
    speakers: list[str] = field(default_factory=list)
    sessions: list[dict[str, Any]] = field(default_factory=list)
    texts: dict[str, str] = field(default_factory=dict)  # text_hash -> text (session and pair texts)
    turns: list[dict[str, Any]] = field(default_factory=list)
    pairs: list[dict[str, Any]] = field(default_factory=list)
    queries: list[dict[str, Any]] = field(default_factory=list)
    #: sessions listed again with the same id and content: (session_id, where first, where again); skipped
    repeats: list[tuple[str, str, str]] = field(default_factory=list)

    def history_row(self) -> dict[str, Any]:
        return {
            "history_id": self.history_id,
            "dataset": self.dataset,
            "speakers": list(self.speakers),
            "n_sessions": len(self.sessions),
        }

    def add_session(
        self,
        session_id: str,
        utterances: list[Utterance],
        *,
        date_raw: str | None,
        date: datetime | None,
        dataset_summary: str | None = None,
    ) -> list[int]:
        """Render a session, add its rows; returns the pair index of every utterance (for evidence)."""
        rendered = [render_utterance(u.role, u.content) for u in utterances]
        pair_texts = pair_up(rendered)
        session_text = "\n".join(pair_texts)
        s_hash = text_hash(session_text)
        self.texts[s_hash] = session_text
        self.sessions.append(
            {
                "history_id": self.history_id,
                "session_id": session_id,
                "position": len(self.sessions),
                "date_raw": date_raw,
                "date": date,
                "text_hash": s_hash,
                "n_turns": len(utterances),
                "dataset_summary": dataset_summary,
            }
        )
        for i, u in enumerate(utterances):
            self.turns.append(
                {
                    "session_hash": s_hash,
                    "turn_index": i,
                    "role": u.role,
                    "content": u.content,
                    "has_answer": u.has_answer,
                    "dia_id": u.dia_id,
                }
            )
        for p, ptext in enumerate(pair_texts):
            members = utterances[2 * p : 2 * p + 2]
            marks = [u.has_answer for u in members if u.has_answer is not None]
            p_hash = text_hash(ptext)
            self.texts[p_hash] = ptext
            self.pairs.append(
                {
                    "session_hash": s_hash,
                    "pair_index": p,
                    "text_hash": p_hash,
                    "has_answer": any(marks) if marks else None,
                    "dia_ids": [u.dia_id for u in members if u.dia_id is not None] or None,
                }
            )
        return [i // 2 for i in range(len(utterances))]


def render_utterance(role: str, content: str) -> str:
    return f"[{role}]: {content}"


def pair_up(rendered: list[str]) -> list[str]:
    """Two consecutive utterances form a retrieval turn; an odd last one stands alone (authors' code)."""
    return ["\n".join(rendered[i : i + 2]) for i in range(0, len(rendered), 2)]


def query_row(
    *,
    query_id: str,
    history_id: str,
    question: str,
    answer: Any,
    question_type: str,
    question_date_raw: str | None = None,
    question_date: datetime | None = None,
    category: int | None = None,
    evidence_session_ids: list[str] | None = None,
    evidence_turn_ids: list[str] | None = None,
    is_abstention: bool = False,
    evidence_utterance_ids: list[str] | None = None,
) -> dict[str, Any]:
    return {
        "query_id": query_id,
        "history_id": history_id,
        "question": question,
        "question_date_raw": question_date_raw,
        "question_date": question_date,
        # answers may be ints (LongMemEval, LoCoMo years): stored as text so the column has one type
        "answer": None if answer is None else str(answer),
        "question_type": question_type,
        "category": category,
        "evidence_session_ids": list(evidence_session_ids or []),
        "evidence_turn_ids": list(evidence_turn_ids or []),
        "evidence_utterance_ids": list(evidence_utterance_ids or []),
        "is_abstention": is_abstention,
    }


def check_evidence(
    rec: HistoryRecord, evidence: list[str], warnings: Warnings, *, field: str, query_id: str
) -> list[str]:
    """Keep the evidence session ids that exist in the history (in the record, or, for an append, already
    in the bank); warn about (and drop) the others."""
    present = {s["session_id"] for s in rec.sessions} | warnings.known_sessions.get(rec.history_id, set())
    kept: list[str] = []
    for sid in evidence:
        if sid in present:
            if sid not in kept:
                kept.append(sid)
        else:
            warnings.warn(
                "missing_evidence",
                f"question {query_id}: evidence session {sid!r} is not in the history (dropped)",
                index=rec.index,
                record_id=rec.history_id,
                field=field,
            )
    return kept


# --------------------------------------------------------------------------------------------------
# dates
# --------------------------------------------------------------------------------------------------
_DATE_FORMATS = (
    "%Y/%m/%d (%a) %H:%M",  # LongMemEval: 2023/05/20 (Sat) 02:21
    "%I:%M %p on %d %B, %Y",  # LoCoMo: 1:56 pm on 8 May, 2023
    "%I:%M %p on %d %b, %Y",
    "%Y-%m-%dT%H:%M:%S",
    "%Y-%m-%d %H:%M:%S",
    "%Y-%m-%dT%H:%M",
    "%Y-%m-%d %H:%M",
    "%Y-%m-%d",
    "%Y/%m/%d %H:%M",
    "%Y/%m/%d",
)


def parse_date(raw: str | None) -> datetime | None:
    """Parse the date formats of the supported datasets (and ISO 8601); None when unparseable."""
    if raw is None:
        return None
    s = raw.strip()
    if not s:
        return None
    for fmt in _DATE_FORMATS:
        try:
            return datetime.strptime(s, fmt)
        except ValueError:
            continue
    try:  # ISO 8601 with a zone: stored as naive UTC-less wall time (schema is timestamp("s") without tz)
        return datetime.fromisoformat(s).replace(tzinfo=None)
    except ValueError:
        return None


# --------------------------------------------------------------------------------------------------
# warnings
# --------------------------------------------------------------------------------------------------
class Warnings:
    """Collects data warnings by kind: logs the first few, counts all; ``strict`` turns them into errors.

    Kinds whose name is in ``once`` are logged only the first time (e.g. unparseable dates, which in a bad
    file would otherwise flood the log), but still counted and exemplified in the summary.
    """

    def __init__(self, file: str, *, strict: bool = False, once: tuple[str, ...] = ("unparseable_date",),
                 known_sessions: dict[str, set[str]] | None = None) -> None:
        self.file = file
        self.strict = strict
        #: session ids each history already has outside the file (an append's bank): evidence may name them
        self.known_sessions = known_sessions or {}
        #: whether the file is appended to a bank (``known_sessions`` given): what a record may leave out differs
        self.appending = known_sessions is not None
        self.once = set(once)
        self.counts: dict[str, int] = {}
        self.examples: dict[str, list[str]] = {}
        self.note_counts: dict[str, dict[str, int]] = {}
        self.note_examples: dict[str, list[str]] = {}

    def warn(
        self,
        kind: str,
        message: str,
        *,
        index: int | None = None,
        record_id: str | None = None,
        field: str | None = None,
    ) -> None:
        err = DataError(self.file, message, index=index, record_id=record_id, field=field)
        if self.strict:
            raise DataError(self.file, f"{message} [{kind}; strict mode]", index=index, record_id=record_id, field=field)
        n = self.counts.get(kind, 0) + 1
        self.counts[kind] = n
        if n <= MAX_EXAMPLES:
            self.examples.setdefault(kind, []).append(str(err))
        if n == 1 or (kind not in self.once and n <= MAX_EXAMPLES):
            log.warning("%s", err)
        elif n == MAX_EXAMPLES + 1 or (kind in self.once and n == 2):
            log.warning("more %r warnings in %s: counted in the ingest summary, not logged", kind, self.file)

    def summary(self) -> dict[str, Any]:
        return {k: {"count": c, "examples": self.examples.get(k, [])} for k, c in sorted(self.counts.items())}

    def note(self, kind: str, message: str, *, index: int | None = None, record_id: str | None = None, n: int = 1) -> None:
        """A fact about the data that changes nothing (e.g. sessions not in date order): counted and
        exemplified in the ingest summary's ``notes`` (and the CLI's summary line), logged once per kind at
        DEBUG, never an error."""
        c = self.note_counts.get(kind)
        if c is None:
            c = self.note_counts[kind] = {"histories": 0, "count": 0}
            log.debug("%s (further %r notes are counted in the ingest summary)",
                     DataError(self.file, message, index=index, record_id=record_id), kind)
        c["histories"] += 1
        c["count"] += n
        if c["histories"] <= MAX_EXAMPLES:
            self.note_examples.setdefault(kind, []).append(str(DataError(self.file, message, index=index, record_id=record_id)))

    def notes(self) -> dict[str, Any]:
        return {k: {**c, "examples": self.note_examples.get(k, [])} for k, c in sorted(self.note_counts.items())}

    @property
    def total(self) -> int:
        """All warnings of every kind."""
        return sum(self.counts.values())


# --------------------------------------------------------------------------------------------------
# field checks (every failure is a one-line DataError naming file, record, field, expectation)
# --------------------------------------------------------------------------------------------------
class Ctx:
    """Where a check happens: the file and the record (index, id)."""

    def __init__(self, file: str, index: int | None = None, record_id: str | None = None) -> None:
        self.file, self.index, self.record_id = file, index, record_id

    def error(self, message: str, field: str | None = None) -> DataError:
        return DataError(self.file, message, index=self.index, record_id=self.record_id, field=field)

    def get(self, obj: dict[str, Any], key: str, types: type | tuple[type, ...], *, where: str = "", required: bool = True) -> Any:
        name = f"{where}{key}"
        if key not in obj or obj[key] is None:
            if required:
                raise self.error(f"missing required field (expected {_tname(types)})", name)
            return None
        value = obj[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
            raise self.error(f"expected {_tname(types)}, got {type(value).__name__}", name)
        return value


def _tuple(t: type | tuple[type, ...]) -> tuple[type, ...]:
    return t if isinstance(t, tuple) else (t,)


def _tname(t: type | tuple[type, ...]) -> str:
    names = {dict: "object", list: "array", str: "string", int: "integer", float: "number", bool: "boolean"}
    return " or ".join(names.get(x, x.__name__) for x in _tuple(t))


def expect_dict(ctx: Ctx, value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ctx.error(f"expected an object, got {_json_type(value)}", what)
    return value


def _json_type(v: Any) -> str:
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, bool):
        return "a boolean"
    if v is None:
        return "null"
    return "a number"


def id_str(ctx: Ctx, value: Any, field: str) -> str:
    """Ids may be given as numbers in hand-made files; they are keys, so always strings."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ctx.error(f"expected a string id, got {_json_type(value)}", field)
    s = str(value)
    if not s:
        raise ctx.error("expected a non-empty id", field)
    return s


# --------------------------------------------------------------------------------------------------
# streaming JSON
# --------------------------------------------------------------------------------------------------
class CountingReader(io.RawIOBase):
    """A binary reader that counts bytes (for progress bars and error offsets)."""

    def __init__(self, f: IO[bytes], on_read: Callable[[int], None] | None = None) -> None:
        self.f = f
        self.pos = 0
        self.on_read = on_read

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        self.pos += len(data)
        if self.on_read is not None and data:
            self.on_read(len(data))
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def first_invalid_utf8(path: str | Path, chunk: int = 1 << 22) -> int | None:
    """Byte offset of the first invalid UTF-8 sequence in the file, or None (streamed, constant memory)."""
    dec = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            final = not block
            # the decoder may hold up to 3 bytes of the previous block; exc.start counts from them
            pending = len(dec.getstate()[0])
            try:
                dec.decode(block, final)
            except UnicodeDecodeError as exc:
                return offset - pending + exc.start
            if final:
                return None
            offset += len(block)


def _first_byte(path: Path) -> tuple[bytes, int]:
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    i = 3 if head.startswith(codecs.BOM_UTF8) else 0
    while i < len(head) and head[i : i + 1] in (b" ", b"\t", b"\r", b"\n"):
        i += 1
    return head[i : i + 1], i


#: Deepest nesting a record may have. The supported formats nest at most 7 levels (LoCoMo); deeper input
#: is not a dataset, and without a bound a 200 KB file of 100,000 "[" drove a JSON parser to 23 GB of
#: memory (ijson's path prefixes grow with depth, so their total size grows with its square).
MAX_DEPTH = 64


def iter_json_array(path: str | Path, on_read: Callable[[int], None] | None = None) -> Iterator[tuple[int, Any]]:
    """Stream the items of a top-level JSON array: memory bounded by one item, nesting by ``MAX_DEPTH``.

    Items are built from ijson's ``basic_parse`` events (no path prefixes), so a deeply nested file fails
    at depth ``MAX_DEPTH`` within milliseconds. Every parse failure is a one-line :class:`DataError`:
    wrong top-level type, truncated or malformed JSON (with the approximate byte offset), numbers out of
    range, too deep nesting and non-UTF-8 bytes (with the exact offset).
    """
    p = Path(path)
    file = str(p)
    if not p.is_file():
        raise DataError(file, "no such file" if not p.exists() else "not a regular file")
    first, _ = _first_byte(p)
    if first == b"":
        raise DataError(file, "empty file; expected a JSON array of records")
    if first and first[0] >= 0x80:  # no JSON text starts with a non-ASCII byte: most likely not UTF-8
        raise _utf8_error(p, 0) if first_invalid_utf8(p) is not None else DataError(
            file, f"expected a JSON array of records at the top level, found byte {first!r}")
    if first != b"[":
        kind = {b"{": "an object"}.get(first, f"{first!r}")
        raise DataError(file, f"expected a JSON array of records at the top level, found {kind}")
    with open(p, "rb") as raw:
        if raw.read(3) != codecs.BOM_UTF8:
            raw.seek(0)
        reader = CountingReader(raw, on_read)
        index = 0
        try:
            for item in _build_items(ijson.basic_parse(io.BufferedReader(reader, 1 << 16), use_float=True), reader):
                yield index, item
                index += 1
        except _DuplicateKey as exc:
            raise DataError(file, f"duplicate key {exc.args[0]!r} in one object near byte {reader.pos} (only one "
                            "value per key can be kept; remove or rename the other)", index=index) from None
        except _LoneSurrogate:
            raise DataError(file, f"{LONE_SURROGATE} (near byte {reader.pos})", index=index) from None
        except _TooDeep:
            raise DataError(
                file, f"JSON nested deeper than {MAX_DEPTH} levels near byte {reader.pos} (the supported formats "
                "nest at most 7); not a dataset file", index=index) from None
        except ijson.common.IncompleteJSONError as exc:
            raise _parse_error(p, exc, reader.pos, index) from None
        except UnicodeDecodeError:
            raise _utf8_error(p, index) from None
        except (ijson.common.JSONError, ValueError, OverflowError) as exc:
            raise _parse_error(p, exc, reader.pos, index) from None


class _TooDeep(Exception):
    pass


class _LoneSurrogate(Exception):
    pass


#: the one line for a string holding half of a UTF-16 surrogate pair (a JSON escape such as ``\ud800``):
#: it is no Unicode text, and every later step (Parquet, the tokenizer, reports) would fail on it
LONE_SURROGATE = ("a lone UTF-16 surrogate escape (such as \\ud800) in a string: not valid Unicode text; "
                  "fix or remove the escape")
_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(obj: Any) -> bool:
    """Whether any string (key or value) in the parsed JSON value ``obj`` holds a lone surrogate
    (iterative; valid pairs like ``\ud83d\ude00`` were already joined into one character by the parser)."""
    todo = [obj]
    while todo:
        o = todo.pop()
        if type(o) is str:
            if not o.isascii() and _SURROGATE.search(o):
                return True
        elif type(o) is dict:
            todo.extend(o.keys())
            todo.extend(o.values())
        elif type(o) is list:
            todo.extend(o)
    return False


class _DuplicateKey(Exception):
    pass


def _build_items(events: Iterator[tuple[str, Any]], reader: CountingReader) -> Iterator[Any]:
    """The values of a top-level array, built from ``basic_parse`` events (depth checked as they come)."""
    stack: list[Any] = []  # open containers below the top-level array
    keys: list[Any] = []  # the pending key of each open container (None for arrays)
    depth = 0
    for ev, val in events:
        # ijson's C backend turns a lone surrogate escape into "?"; the Python backends pass it through
        if type(val) is str and not val.isascii() and _SURROGATE.search(val):
            raise _LoneSurrogate
        if ev == "map_key":
            if val in stack[-1]:  # JSON allows it; a loader would silently see only the last value
                raise _DuplicateKey(val)
            keys[-1] = val
        elif ev == "start_map" or ev == "start_array":
            depth += 1
            if depth > MAX_DEPTH:
                raise _TooDeep
            if depth == 1:
                continue
            new: Any = {} if ev == "start_map" else []
            if stack:
                top = stack[-1]
                if type(top) is list:
                    top.append(new)
                else:
                    top[keys[-1]] = new
            stack.append(new)
            keys.append(None)
        elif ev == "end_map" or ev == "end_array":
            depth -= 1
            if depth == 0:
                # anything but whitespace after the array is malformed: let the parser say so
                for _ in events:
                    pass
                return
            done = stack.pop()
            keys.pop()
            if depth == 1:
                yield done
        elif depth == 1:  # a scalar item of the top-level array
            yield val
        else:
            top = stack[-1]
            if type(top) is list:
                top.append(val)
            else:
                top[keys[-1]] = val


def _utf8_error(p: Path, index: int) -> DataError:
    off = first_invalid_utf8(p)
    where = f"byte offset {off}" if off is not None else "an unknown offset"
    return DataError(str(p), f"not valid UTF-8: invalid byte sequence at {where}; re-encode the file as UTF-8", index=index)


def _parse_error(p: Path, exc: Exception, pos: int, index: int) -> DataError:
    off = first_invalid_utf8(p)
    if off is not None:
        return _utf8_error(p, index)
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    size = p.stat().st_size
    low = msg.lower()
    if "incomplete" in low or "premature" in low:
        return DataError(str(p), f"truncated JSON: the file ends inside a record (read {pos} of {size} bytes): {msg}", index=index)
    if "trailing garbage" in low:
        return DataError(str(p), f"unexpected data after the top-level array (before byte {pos}): {msg}", index=index)
    if "overflow" in low or "exceeds the limit" in low:
        return DataError(str(p), f"a number out of range (before byte {pos}): {msg}", index=index)
    return DataError(str(p), f"malformed JSON {'before' if pos >= size else 'near'} byte {pos}: {msg}", index=index)



def stream_records(
    path: str | Path,
    warnings: Warnings,
    parse: Callable[[int, Any, str, Warnings], HistoryRecord | None],
    *,
    on_read: Callable[[int], None] | None = None,
    items: Callable[..., Iterator[tuple[int, Any]]] | None = None,
) -> Iterator[HistoryRecord]:
    """The loop every loader shares: stream raw items, parse each, skip the ones ``parse`` drops (None)."""
    file = str(path)
    for index, item in (items or iter_json_array)(path, on_read):
        rec = parse(index, item, file, warnings)
        if rec is not None:
            yield rec
