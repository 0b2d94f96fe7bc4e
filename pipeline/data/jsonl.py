"""memgas' own history format: JSON Lines, one history per line (see docs/data.md).

    {"history_id": "u1",
     "sessions": [{"session_id": "s1", "date": "2024-03-01 10:00",
                   "turns": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}],
     "questions": [{"query_id": "u1:q0", "question": "...", "answer": "...", "question_date": "...",
                    "question_type": "...", "evidence_session_ids": ["s1"]}]}

``date``, ``questions`` and every question field but ``query_id`` and ``question`` are optional; a turn
may carry ``has_answer`` (turn-level evidence). Blank lines are skipped. Each line is decoded on its own,
so a bad byte is reported with its exact offset in the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from memgas.pipeline.data.common import (
    LONE_SURROGATE,
    MAX_DEPTH,
    stream_records,
    Ctx,
    HistoryRecord,
    Utterance,
    Warnings,
    check_evidence,
    has_lone_surrogate,
    expect_dict,
    id_str,
    parse_date,
    query_row,
)
from memgas.pipeline.data.longmemeval import add_chat_session, note_date_order, parse_turns, report_repeats
from memgas.pipeline.errors import DataError

DATASET = "jsonl"
DEFAULT_QUESTION_TYPE = "unknown"


def parse_history(index: int, item: Any, file: str, warnings: Warnings) -> HistoryRecord | None:
    ctx = Ctx(file, index)
    item = expect_dict(ctx, item, "line")
    if "history_id" not in item:
        raise ctx.error("missing required field (expected a string id)", "history_id")
    hid = id_str(ctx, item["history_id"], "history_id")
    ctx.record_id = hid
    sessions = ctx.get(item, "sessions", list)
    questions = ctx.get(item, "questions", list, required=False) or []
    speakers = ctx.get(item, "speakers", list, required=False)
    rec = HistoryRecord(history_id=hid, dataset=DATASET, index=index)
    seen: dict[str, tuple[str, list[Utterance]]] = {}
    evidence_turns: list[str] = []
    evidence_utts: list[str] = []
    for k, s in enumerate(sessions):
        w = f"sessions[{k}]"
        s = expect_dict(ctx, s, w)
        if "session_id" not in s:
            raise ctx.error("missing required field (expected a string id)", f"{w}.session_id")
        sid = id_str(ctx, s["session_id"], f"{w}.session_id")
        date_raw = ctx.get(s, "date", str, where=f"{w}.", required=False)
        utts = parse_turns(ctx, ctx.get(s, "turns", list, where=f"{w}."), f"{w}.turns")
        add_chat_session(rec, ctx, warnings, sid, utts, date_raw, w, seen, evidence_turns, evidence_utts)
    report_repeats(rec, warnings)
    note_date_order(rec, warnings)
    if not rec.sessions and hid not in warnings.known_sessions:  # an append may bring only new questions
        if warnings.appending and not sessions and questions:  # ... to a known history: else they are lost
            raise ctx.error(f"a record without sessions adds questions to a history the bank holds, but {hid!r} is "
                            "not in the bank (check the id, or add the history with its sessions)", "sessions")
        warnings.warn("empty_history", "history has no non-empty session (skipped)", index=index, record_id=hid, field="sessions")
        return None
    if speakers is not None:
        rec.speakers = [str(x) for x in speakers]
    else:  # speakers = the roles in order of appearance
        rec.speakers = list(dict.fromkeys(t["role"] for t in rec.turns))
    qids: set[str] = set()
    for qi, q in enumerate(questions):
        w = f"questions[{qi}]"
        q = expect_dict(ctx, q, w)
        if "query_id" not in q:
            raise ctx.error("missing required field (expected a string id)", f"{w}.query_id")
        qid = id_str(ctx, q["query_id"], f"{w}.query_id")
        if qid in qids:
            raise ctx.error(f"duplicate query id {qid!r}", f"{w}.query_id")
        qids.add(qid)
        question = ctx.get(q, "question", str, where=f"{w}.")
        answer = ctx.get(q, "answer", (str, int, float), where=f"{w}.", required=False)
        qtype = ctx.get(q, "question_type", str, where=f"{w}.", required=False) or DEFAULT_QUESTION_TYPE
        qdate_raw = ctx.get(q, "question_date", str, where=f"{w}.", required=False)
        qdate = parse_date(qdate_raw)
        if qdate_raw is not None and qdate is None:
            warnings.warn("unparseable_date", f"date {qdate_raw!r} does not parse (kept raw)", index=index, record_id=hid, field=f"{w}.question_date")
        ev_raw = ctx.get(q, "evidence_session_ids", list, where=f"{w}.", required=False) or []
        ev = [id_str(ctx, e, f"{w}.evidence_session_ids[{i}]") for i, e in enumerate(ev_raw)]
        ev = check_evidence(rec, ev, warnings, field=f"{w}.evidence_session_ids", query_id=qid)
        # turn-level evidence: has_answer marks inside this question's evidence sessions
        ev_turns = [t for t in evidence_turns if t.rsplit(":", 1)[0] in ev] if ev else []
        ev_utts = [t for t in evidence_utts if t.rsplit(":", 1)[0] in ev] if ev else []
        rec.queries.append(
            query_row(
                query_id=qid,
                history_id=hid,
                question=question,
                answer=answer,
                question_type=qtype,
                question_date_raw=qdate_raw,
                question_date=qdate,
                evidence_session_ids=ev,
                evidence_turn_ids=ev_turns,
                evidence_utterance_ids=ev_utts,
                is_abstention=bool(q.get("is_abstention", False)) or qid.endswith("_abs"),
            )
        )
    return rec


def iter_lines(path: str | Path, on_read: Callable[[int], None] | None = None) -> Iterator[tuple[int, Any]]:
    """(record index, parsed object) per non-blank line; one-line DataError for bad bytes or JSON."""
    p = Path(path)
    if not p.is_file():
        raise DataError(str(p), "no such file" if not p.exists() else "not a regular file")
    offset = 0
    index = 0
    with open(p, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if on_read is not None:
                on_read(len(raw))
            start = offset
            offset += len(raw)
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw, start = raw[3:], start + 3
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(str(p), f"line {lineno}: not valid UTF-8: invalid byte sequence at byte offset {start + exc.start}", index=index) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line, object_pairs_hook=_unique_keys)
            except _DuplicateKey as exc:
                raise DataError(str(p), f"line {lineno}: duplicate key {exc.args[0]!r} in one object (only one value "
                                "per key can be kept; remove or rename the other)", index=index) from None
            except json.JSONDecodeError as exc:
                what = "truncated JSON" if exc.pos >= len(line.rstrip()) else "malformed JSON"
                raise DataError(str(p), f"line {lineno}: {what} at column {exc.colno} (byte offset ~{start + exc.pos}): {exc.msg}", index=index) from None
            except RecursionError:
                raise DataError(str(p), f"line {lineno}: JSON nested too deeply (the format nests at most 6 levels); not a history", index=index) from None
            except ValueError as exc:  # e.g. an integer of more than 4300 digits
                raise DataError(str(p), f"line {lineno}: {str(exc).splitlines()[0]}", index=index) from None
            if _depth_over(obj, MAX_DEPTH):
                raise DataError(str(p), f"line {lineno}: JSON nested deeper than {MAX_DEPTH} levels; not a history", index=index)
            if ("\\ud" in line or "\\uD" in line) and has_lone_surrogate(obj):  # only an escape can make one
                raise DataError(str(p), f"line {lineno}: {LONE_SURROGATE}", index=index)
            yield index, obj
            index += 1


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: the standard library keeps the last of two equal keys without a word."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return d


def _depth_over(obj: Any, limit: int) -> bool:
    """Whether ``obj`` nests deeper than ``limit`` containers (iterative: no recursion limit to hit)."""
    todo = [(obj, 1)] if isinstance(obj, (dict, list)) else []
    while todo:
        o, d = todo.pop()
        if d > limit:
            return True
        todo.extend((v, d + 1) for v in (o.values() if type(o) is dict else o) if type(v) in (dict, list))
    return False


def load(
    path: str | Path, warnings: Warnings, *, on_read: Callable[[int], None] | None = None
) -> Iterator[HistoryRecord]:
    """Stream one :class:`HistoryRecord` per line."""
    return stream_records(path, warnings, parse_history, on_read=on_read, items=iter_lines)
