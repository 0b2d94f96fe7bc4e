"""memgas' own JSONL history format."""

from __future__ import annotations

import json
from pathlib import Path

from memgas.pipeline.data import jsonl
from memgas.pipeline.data.common import Warnings

LINES = [
    {
        "history_id": "u1",
        "sessions": [
            {"session_id": "s1", "date": "2024-03-01 10:00", "turns": [{"role": "user", "content": "I moved to Oslo."}, {"role": "assistant", "content": "Nice!", "has_answer": False}]},
            {"session_id": "s2", "turns": [{"role": "user", "content": "My cat is Tom.", "has_answer": True}]},
        ],
        "questions": [
            {"query_id": "u1:q0", "question": "Where do I live?", "answer": "Oslo", "question_date": "2024-04-01", "question_type": "single-session-user", "evidence_session_ids": ["s1"]},
            {"query_id": "u1:q1", "question": "Cat's name?", "evidence_session_ids": ["s2"]},
        ],
    },
    {"history_id": "u2", "sessions": [{"session_id": "a", "turns": [{"role": "me", "content": "hello"}]}]},
]


def test_roundtrip(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in LINES) + "\n\n")
    w = Warnings(str(path))
    recs = list(jsonl.load(path, w))
    assert not w.counts
    assert [r.history_id for r in recs] == ["u1", "u2"]
    u1 = recs[0]
    assert u1.speakers == ["user", "assistant"]
    assert u1.sessions[0]["date"].isoformat() == "2024-03-01T10:00:00" and u1.sessions[1]["date_raw"] is None
    q0, q1 = u1.queries
    assert q0["evidence_session_ids"] == ["s1"] and q0["evidence_turn_ids"] == []
    assert q1["evidence_turn_ids"] == ["s2:0"] and q1["question_type"] == "unknown" and q1["answer"] is None
    assert recs[1].queries == []
