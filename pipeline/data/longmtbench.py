"""Long-MT-Bench+ (as used by MemGAS): a JSON array of {conversation_id, sessions, questions, answers}.

A session is a list of turns {role, content}. The dataset has no retrieval ground truth, so queries carry
no evidence (retrieval metrics skip them; QA metrics still apply). Sessions get ids ``session_1..N`` in
file order, as in the authors' preprocessing; there are no dates.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from memgas.pipeline.data.common import (
    Ctx, HistoryRecord, Utterance, Warnings, expect_dict, id_str, query_row, stream_records,
)
from memgas.pipeline.data.longmemeval import add_chat_session, parse_turns

DATASET = "longmtbench"
QUESTION_TYPE = "long-mt-bench"


def parse_conversation(index: int, item: Any, file: str, warnings: Warnings) -> HistoryRecord | None:
    ctx = Ctx(file, index)
    item = expect_dict(ctx, item, "item")
    if "conversation_id" not in item:
        raise ctx.error("missing required field (expected a string id)", "conversation_id")
    cid = id_str(ctx, item["conversation_id"], "conversation_id")
    ctx.record_id = cid
    sessions = ctx.get(item, "sessions", list)
    questions = ctx.get(item, "questions", list, required=False) or []
    answers = ctx.get(item, "answers", list, required=False) or []
    if len(questions) != len(answers):
        raise ctx.error(f"questions ({len(questions)}) and answers ({len(answers)}) must have the same length", "answers")
    rec = HistoryRecord(history_id=cid, dataset=DATASET, index=index, speakers=["user", "assistant"])
    seen: dict[str, tuple[str, list[Utterance]]] = {}
    for k, sess in enumerate(sessions):
        utts = parse_turns(ctx, sess, f"sessions[{k}]")
        add_chat_session(rec, ctx, warnings, f"session_{k + 1}", utts, None, f"sessions[{k}]", seen, [])
    if not rec.sessions:
        warnings.warn("empty_history", "conversation has no non-empty session (skipped)", index=index, record_id=cid, field="sessions")
        return None
    for qi, (q, a) in enumerate(zip(questions, answers)):
        if not isinstance(q, str):
            raise ctx.error(f"expected a string, got {type(q).__name__}", f"questions[{qi}]")
        if a is not None and not isinstance(a, (str, int, float)):
            raise ctx.error(f"expected a string, got {type(a).__name__}", f"answers[{qi}]")
        rec.queries.append(
            query_row(query_id=f"{cid}:q{qi}", history_id=cid, question=q, answer=a, question_type=QUESTION_TYPE)
        )
    return rec


def load(
    path: str | Path, warnings: Warnings, *, on_read: Callable[[int], None] | None = None
) -> Iterator[HistoryRecord]:
    """Stream one :class:`HistoryRecord` per conversation (history_id = conversation_id)."""
    return stream_records(path, warnings, parse_conversation, on_read=on_read)
