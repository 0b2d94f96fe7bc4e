"""Long-MT-Bench+ loader on a small hand-written fixture (no file of the real dataset is available)."""

from __future__ import annotations

import json
from pathlib import Path

from memgas.pipeline.data import longmtbench
from memgas.pipeline.data.common import Warnings

FIXTURE = [
    {
        "conversation_id": "lmt-1",
        "sessions": [
            [{"role": "user", "content": "Write a haiku about rain."}, {"role": "assistant", "content": "Soft rain on tin roofs"}],
            [{"role": "user", "content": "Now one about snow."}, {"role": "assistant", "content": "White hush"}, {"role": "user", "content": "Thanks"}],
        ],
        "questions": ["What was the first haiku about?", "What did I thank you for?"],
        "answers": ["rain", "the snow haiku"],
    },
    {"conversation_id": 7, "sessions": [[{"role": "user", "content": "hi"}]], "questions": [], "answers": []},
]


def test_fixture(tmp_path: Path) -> None:
    path = tmp_path / "lmt.json"
    path.write_text(json.dumps(FIXTURE))
    recs = list(longmtbench.load(path, Warnings(str(path))))
    assert [r.history_id for r in recs] == ["lmt-1", "7"]
    r = recs[0]
    assert [s["session_id"] for s in r.sessions] == ["session_1", "session_2"]
    assert [s["n_turns"] for s in r.sessions] == [2, 3]
    assert len(r.pairs) == 1 + 2
    assert r.texts[r.sessions[1]["text_hash"]] == "[user]: Now one about snow.\n[assistant]: White hush\n[user]: Thanks"
    assert [q["query_id"] for q in r.queries] == ["lmt-1:q0", "lmt-1:q1"]
    assert all(q["evidence_session_ids"] == [] and q["answer"] for q in r.queries)
