"""LoCoMo (``locomo10.json``): one history per conversation between two people.

Rendering follows the MemGAS authors' preprocessing (``data/dataprocess.py``, ``process_locomo10``): an
utterance is ``"[speaker]: text"`` and, when it shares an image, BLIP's caption is appended as
``text + "\\n The image Caption: " + caption`` (their exact string, so that our texts and hashes equal
theirs). The caption goes into ``turns.content`` so that the rendered pair text is reproducible from it.

Evidence ``"D3:5"`` = session 3, dialog 5. A few strings in the file hold several ids (``"D8:6; D9:17"``,
``"D9:1 D4:4 D4:6"``) or a stray colon (``"D:11:26"``): every id in the string is parsed; leftovers that
are not ids (``"D"``) are reported as ``unparseable_evidence``; ids naming a missing session or dialog
are reported as ``missing_evidence`` and dropped. Neither stops the load (``strict`` makes them errors).
"""

from __future__ import annotations

import logging
import re
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
    expect_dict,
    id_str,
    parse_date,
    query_row,
)
from memgas.pipeline.evaluate.categories import LOCOMO_CATEGORIES

log = logging.getLogger(__name__)

DATASET = "locomo"
CAPTION_SEP = "\n The image Caption: "  # the MemGAS authors' rendering of a shared image

_SESSION_RE = re.compile(r"session_(\d+)")
_EVIDENCE_RE = re.compile(r"D\s*:?\s*(\d+)\s*:\s*(\d+)")
_EVIDENCE_JUNK = re.compile(r"[\s;,]+")


def parse_evidence(raw: str) -> tuple[list[tuple[int, int]], str]:
    """All (session, dialog) ids in one evidence string, and what is left that is not an id."""
    ids = [(int(s), int(d)) for s, d in _EVIDENCE_RE.findall(raw)]
    rest = _EVIDENCE_JUNK.sub("", _EVIDENCE_RE.sub("", raw))
    return ids, rest


def parse_conversation(index: int, item: Any, file: str, warnings: Warnings) -> HistoryRecord | None:
    ctx = Ctx(file, index)
    item = expect_dict(ctx, item, "item")
    if "sample_id" not in item:
        raise ctx.error("missing required field (expected a string id)", "sample_id")
    sample_id = id_str(ctx, item["sample_id"], "sample_id")
    ctx.record_id = sample_id
    conv = ctx.get(item, "conversation", dict)
    qa = ctx.get(item, "qa", list, required=False) or []
    summaries = ctx.get(item, "session_summary", dict, required=False) or {}
    speakers = [ctx.get(conv, k, str, where="conversation.") for k in ("speaker_a", "speaker_b")]

    numbers = sorted(int(m.group(1)) for k in conv if (m := _SESSION_RE.fullmatch(k)))
    rec = HistoryRecord(history_id=sample_id, dataset=DATASET, index=index, speakers=speakers)
    # (session number, dialog id) -> (session_id, pair index), for evidence; and -> turn_index (utterance)
    where_is: dict[str, tuple[str, int]] = {}
    utt_of: dict[str, int] = {}
    for n in numbers:
        sid = f"session_{n}"
        raw = conv[sid]
        if not isinstance(raw, list):
            raise ctx.error(f"expected an array of dialogs, got {type(raw).__name__}", f"conversation.{sid}")
        utts: list[Utterance] = []
        for j, d in enumerate(raw):
            w = f"conversation.{sid}[{j}]."
            d = expect_dict(ctx, d, w[:-1])
            speaker = ctx.get(d, "speaker", str, where=w)
            text = ctx.get(d, "text", str, where=w)
            dia_id = ctx.get(d, "dia_id", str, where=w, required=False)
            caption = d.get("blip_caption")
            if caption is not None and not isinstance(caption, str):
                raise ctx.error(f"expected a string, got {type(caption).__name__}", f"{w}blip_caption")
            content = text + CAPTION_SEP + caption if caption else text
            if dia_id is not None and dia_id in where_is:
                raise ctx.error(f"duplicate dia_id {dia_id!r}", f"{w}dia_id")
            utts.append(Utterance(role=speaker, content=content, dia_id=dia_id))
        if no_text(utts):
            what = "has only blank dialogs" if utts else "has no dialogs"
            warnings.warn("empty_session", f"session {sid!r} {what} (skipped)", index=index, record_id=sample_id, field=f"conversation.{sid}")
            continue
        date_raw = ctx.get(conv, f"{sid}_date_time", str, where="conversation.", required=False)
        date = parse_date(date_raw)
        if date_raw is not None and date is None:
            warnings.warn("unparseable_date", f"date {date_raw!r} does not parse (kept raw)", index=index, record_id=sample_id, field=f"conversation.{sid}_date_time")
        summary = summaries.get(f"{sid}_summary")
        pair_of = rec.add_session(
            sid, utts, date_raw=date_raw, date=date, dataset_summary=summary if isinstance(summary, str) else None
        )
        for j, u in enumerate(utts):
            if u.dia_id is not None:
                where_is[u.dia_id] = (sid, pair_of[j])
                utt_of[u.dia_id] = j
    if not rec.sessions:
        warnings.warn("empty_history", "conversation has no non-empty session (skipped)", index=index, record_id=sample_id, field="conversation")
        return None
    present = {s["session_id"] for s in rec.sessions}

    for qi, q in enumerate(qa):
        qctx_field = f"qa[{qi}]."
        q = expect_dict(ctx, q, f"qa[{qi}]")
        qid = f"{sample_id}:q{qi}"
        question = ctx.get(q, "question", str, where=qctx_field)
        category = ctx.get(q, "category", int, where=qctx_field)
        # adversarial (category 5) items carry their answer in adversarial_answer (authors' convention)
        if q.get("adversarial_answer") is not None:
            answer = ctx.get(q, "adversarial_answer", (str, int, float), where=qctx_field)
        else:
            answer = ctx.get(q, "answer", (str, int, float), where=qctx_field, required=False)
        evidence_raw = ctx.get(q, "evidence", list, where=qctx_field, required=False) or []
        ev_sessions: list[str] = []
        ev_turns: list[str] = []
        ev_utts: list[str] = []
        for ei, e in enumerate(evidence_raw):
            field = f"{qctx_field}evidence[{ei}]"
            if not isinstance(e, str):
                raise ctx.error(f"expected a dialog id string like 'D3:5', got {type(e).__name__}", field)
            ids, rest = parse_evidence(e)
            if rest:
                warnings.warn("unparseable_evidence", f"question {qid}: evidence {e!r} is not a dialog id like 'D3:5' (ignored: {rest!r})", index=index, record_id=sample_id, field=field)
            for s, dnum in ids:
                dia = f"D{s}:{dnum}"
                sid = f"session_{s}"
                if dia in where_is:
                    sid, pair = where_is[dia]
                    ref = f"{sid}:{pair}"
                    if ref not in ev_turns:
                        ev_turns.append(ref)
                    if (utt := f"{sid}:{utt_of[dia]}") not in ev_utts:
                        ev_utts.append(utt)
                    if sid not in ev_sessions:
                        ev_sessions.append(sid)
                elif sid in present:
                    # the session exists but not the dialog: keep the session-level evidence
                    warnings.warn("missing_evidence", f"question {qid}: evidence {dia} names no dialog of {sid} (session kept, turn dropped)", index=index, record_id=sample_id, field=field)
                    if sid not in ev_sessions:
                        ev_sessions.append(sid)
                else:
                    warnings.warn("missing_evidence", f"question {qid}: evidence {dia} names a missing session {sid} (dropped)", index=index, record_id=sample_id, field=field)
        if category in LOCOMO_CATEGORIES:
            qtype = LOCOMO_CATEGORIES[category]
        else:
            warnings.warn("unknown_category", f"question {qid}: category {category} is not one of {sorted(LOCOMO_CATEGORIES)}", index=index, record_id=sample_id, field=f"{qctx_field}category")
            qtype = f"category-{category}"
        rec.queries.append(
            query_row(
                query_id=qid,
                history_id=sample_id,
                question=question,
                answer=answer,
                question_type=qtype,
                category=category,
                evidence_session_ids=ev_sessions,
                evidence_turn_ids=ev_turns,
                evidence_utterance_ids=ev_utts,
                is_abstention=False,
            )
        )
    return rec


def load(
    path: str | Path, warnings: Warnings, *, on_read: Callable[[int], None] | None = None
) -> Iterator[HistoryRecord]:
    """Stream one :class:`HistoryRecord` per conversation (history_id = sample_id)."""
    return stream_records(path, warnings, parse_conversation, on_read=on_read)
