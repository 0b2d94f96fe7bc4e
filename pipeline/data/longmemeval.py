"""LongMemEval (oracle / S / M, original and "cleaned" releases): one history per question.

The files are one JSON array of questions; M is ~2.7 GB, so it is parsed as a stream with ijson and
memory is bounded by one question. Fields: question_id, question_type, question, answer, question_date,
haystack_session_ids, haystack_dates, haystack_sessions (a session is a list of {role, content,
has_answer?}), answer_session_ids. Session ids are kept as given, ``answer_`` prefix included: it marks
evidence sessions, so a retrieval system must never look at it (see docs/data.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from memgas.pipeline.data.common import (
    stream_records,
    Ctx,
    HistoryRecord,
    no_text,
    Utterance,
    Warnings,
    check_evidence,
    expect_dict,
    id_str,
    parse_date,
    query_row,
)

log = logging.getLogger(__name__)

DATASET = "longmemeval"


def parse_turns(ctx: Ctx, raw: Any, where: str) -> list[Utterance]:
    """A chat session: a list of {role, content, has_answer?} objects."""
    if not isinstance(raw, list):
        raise ctx.error(f"expected an array of turns, got {type(raw).__name__}", where)
    out: list[Utterance] = []
    for j, t in enumerate(raw):
        w = f"{where}[{j}]"
        t = expect_dict(ctx, t, w)
        role = ctx.get(t, "role", str, where=f"{w}.")
        content = ctx.get(t, "content", str, where=f"{w}.")
        has_answer = ctx.get(t, "has_answer", bool, where=f"{w}.", required=False)
        out.append(Utterance(role=role, content=content, has_answer=has_answer))
    return out


def add_chat_session(
    rec: HistoryRecord,
    ctx: Ctx,
    warnings: Warnings,
    session_id: str,
    utterances: list[Utterance],
    date_raw: str | None,
    where: str,
    seen: dict[str, tuple[str, list[Utterance]]],
    evidence_turns: list[str],
    evidence_utterances: list[str] | None = None,
) -> None:
    """Add one session (skipping empty ones with a warning) and collect its has_answer pairs (and, into
    ``evidence_utterances`` when given, its has_answer utterances as ``session_id:turn_index``).

    ``seen`` maps the session ids of this history to (where, turns) of their first occurrence. The same
    id again with the same turns is a *repeat* (LongMemEval-S as published lists 13 haystack sessions
    twice): the first copy is kept and the repeat recorded in ``rec.repeats`` (reported once per history
    by :func:`report_repeats`). The same id with other turns is an error naming both positions.
    """
    if session_id in seen:
        first_where, first_utts = seen[session_id]
        if first_utts != utterances:
            raise ctx.error(
                f"duplicate session id {session_id!r} within the history with different content "
                f"(first at {first_where})", where)
        rec.repeats.append((session_id, first_where, where))
        return
    seen[session_id] = (where, utterances)
    if no_text(utterances):
        # An empty session has no text to embed or retrieve: skip it (strict mode: error).
        what = "has only blank turns" if utterances else "has no turns"
        warnings.warn("empty_session", f"session {session_id!r} {what} (skipped)", index=ctx.index, record_id=ctx.record_id, field=where)
        return
    date = parse_date(date_raw)
    if date_raw is not None and date is None:
        warnings.warn("unparseable_date", f"date {date_raw!r} does not parse (kept raw)", index=ctx.index, record_id=ctx.record_id, field=where)
    pair_of = rec.add_session(session_id, utterances, date_raw=date_raw, date=date)
    for i, u in enumerate(utterances):
        ref = f"{session_id}:{pair_of[i]}"
        if u.has_answer and ref not in evidence_turns:
            evidence_turns.append(ref)
        if u.has_answer and evidence_utterances is not None:
            evidence_utterances.append(f"{session_id}:{i}")


def report_repeats(rec: HistoryRecord, warnings: Warnings) -> None:
    """One ``repeated_session`` warning per history that lists a session twice (strict mode: an error)."""
    if not rec.repeats:
        return
    sid, first, again = rec.repeats[0]
    more = f" and {len(rec.repeats) - 1} more" if len(rec.repeats) > 1 else ""
    warnings.warn(
        "repeated_session",
        f"session {sid!r} is listed again at {again} with the same content as at {first}{more} "
        "(kept the first copy)",
        index=rec.index, record_id=rec.history_id, field=again,
    )


def note_date_order(rec: HistoryRecord, warnings: Warnings, question_date: Any = None) -> None:
    """Notes (not warnings) about the order of dates: sessions not in date order, sessions after the question.

    Neither changes the load: the MemGAS authors associate sessions in file order, and so do we.
    """
    dates = [s["date"] for s in rec.sessions if s["date"] is not None]
    if any(b < a for a, b in zip(dates, dates[1:])):
        warnings.note("sessions_not_in_date_order", "sessions are not in date order (kept in file order)",
                      index=rec.index, record_id=rec.history_id)
    if question_date is not None and dates and max(dates) > question_date:
        n = sum(d > question_date for d in dates)
        warnings.note("sessions_after_question", f"{n} session(s) dated after the question",
                      index=rec.index, record_id=rec.history_id, n=n)


def parse_question(index: int, item: Any, file: str, warnings: Warnings) -> HistoryRecord | None:
    ctx = Ctx(file, index)
    item = expect_dict(ctx, item, "item")
    qid = id_str(ctx, item.get("question_id"), "question_id") if "question_id" in item else None
    if qid is None:
        raise ctx.error("missing required field (expected a string id)", "question_id")
    ctx.record_id = qid
    qtype = ctx.get(item, "question_type", str)
    question = ctx.get(item, "question", str)
    answer = ctx.get(item, "answer", (str, int, float))
    qdate_raw = ctx.get(item, "question_date", str, required=False)
    sids = ctx.get(item, "haystack_session_ids", list)
    dates = ctx.get(item, "haystack_dates", list)
    sessions = ctx.get(item, "haystack_sessions", list)
    answer_sids = ctx.get(item, "answer_session_ids", list, required=False) or []
    if not (len(sids) == len(dates) == len(sessions)):
        raise ctx.error(
            f"haystack_session_ids ({len(sids)}), haystack_dates ({len(dates)}) and haystack_sessions "
            f"({len(sessions)}) must have the same length",
            "haystack_sessions",
        )
    rec = HistoryRecord(history_id=qid, dataset=DATASET, index=index, speakers=["user", "assistant"])
    seen: dict[str, tuple[str, list[Utterance]]] = {}
    evidence_turns: list[str] = []
    evidence_utts: list[str] = []
    for k, (sid, draw, sess) in enumerate(zip(sids, dates, sessions)):
        sid = id_str(ctx, sid, f"haystack_session_ids[{k}]")
        if draw is not None and not isinstance(draw, str):
            raise ctx.error(f"expected a date string, got {type(draw).__name__}", f"haystack_dates[{k}]")
        utts = parse_turns(ctx, sess, f"haystack_sessions[{k}]")
        add_chat_session(rec, ctx, warnings, sid, utts, draw, f"haystack_sessions[{k}]", seen, evidence_turns,
                         evidence_utts)
    report_repeats(rec, warnings)
    if not rec.sessions:
        warnings.warn("empty_history", "history has no non-empty session (question skipped)", index=index, record_id=qid, field="haystack_sessions")
        return None
    evidence = [id_str(ctx, s, f"answer_session_ids[{i}]") for i, s in enumerate(answer_sids)]
    evidence = check_evidence(rec, evidence, warnings, field="answer_session_ids", query_id=qid)
    qdate = parse_date(qdate_raw)
    if qdate_raw is not None and qdate is None:
        warnings.warn("unparseable_date", f"date {qdate_raw!r} does not parse (kept raw)", index=index, record_id=qid, field="question_date")
    note_date_order(rec, warnings, qdate)
    rec.queries.append(
        query_row(
            query_id=qid,
            history_id=qid,
            question=question,
            answer=answer,
            question_type=qtype,
            question_date_raw=qdate_raw,
            question_date=qdate,
            evidence_session_ids=evidence,
            evidence_turn_ids=evidence_turns,
            evidence_utterance_ids=evidence_utts,
            is_abstention=qid.endswith("_abs"),
        )
    )
    return rec


def load(
    path: str | Path, warnings: Warnings, *, on_read: Callable[[int], None] | None = None
) -> Iterator[HistoryRecord]:
    """Stream one :class:`HistoryRecord` per question (history_id = question_id)."""
    return stream_records(path, warnings, parse_question, on_read=on_read)
