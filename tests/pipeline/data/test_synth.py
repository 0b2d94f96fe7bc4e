"""Synthetic histories: same bytes for the same seed, and the planted evidence is where it says."""

from __future__ import annotations

import json
import re
from pathlib import Path

from memgas.pipeline.data.synth import synth
from memgas.pipeline.ingest import ingest

KW = dict(questions=30, sessions_per_history=12, turns_per_session=6, reuse_share=0.5, multi_session_share=0.4)


def test_deterministic(tmp_path: Path) -> None:
    a = synth(tmp_path / "a.json", seed=3, **KW).read_bytes()
    b = synth(tmp_path / "b.json", seed=3, **KW).read_bytes()
    c = synth(tmp_path / "c.json", seed=4, **KW).read_bytes()
    assert a == b and a != c


def test_evidence_is_right(tmp_path: Path) -> None:
    data = json.loads(synth(tmp_path / "s.json", seed=0, **KW).read_text())
    assert len(data) == 30
    types = {q["question_type"] for q in data}
    assert types == {"multi-session", "single-session-user"}
    for q in data:
        assert len(q["haystack_sessions"]) == 12 and all(len(s) == 6 for s in q["haystack_sessions"])
        assert len(set(q["haystack_session_ids"])) == 12
        ev = q["answer_session_ids"]
        assert len(ev) == (2 if q["question_type"] == "multi-session" else 1)
        marked = [
            (sid, t["content"])
            for sid, sess in zip(q["haystack_session_ids"], q["haystack_sessions"])
            for t in sess
            if t.get("has_answer")
        ]
        # exactly one marked user turn per evidence session, none elsewhere
        assert [sid for sid, _ in marked] == ev
        if q["question_type"] == "multi-session":
            nums = [int(re.search(r"\b(\d)\b (?:courses|fiction|non-fiction|books|succulents|ferns|races)", c).group(1)) for _, c in marked]
            assert sum(nums) == q["answer"]
        else:
            assert str(q["answer"]) in marked[0][1]
        assert q["haystack_dates"] == sorted(q["haystack_dates"])


def test_reuse_exercises_dedup(tmp_path: Path) -> None:
    path = synth(tmp_path / "s.json", seed=0, **KW)
    s = ingest(path, "longmemeval", tmp_path / "bank", progress=False)
    assert s["warnings"] == {} and s["queries"] == 30
    assert s["unique_sessions"] < s["sessions"]  # shared pool sessions are stored once
    none = synth(tmp_path / "n.json", seed=0, **{**KW, "reuse_share": 0.0})
    s0 = ingest(none, "longmemeval", tmp_path / "bank0", progress=False)
    assert s0["unique_sessions"] == s0["sessions"]


def test_the_m_shape_and_its_overrides(tmp_path: Path) -> None:
    """`memgas synth --shape m`: LongMemEval-M's histories (500 sessions of 10 utterances, every distractor from
    one shared pool of 43,000 sessions, 1.9 evidence sessions a question); options override the shape; no
    shape keeps the small defaults."""
    from memgas.jobs import cli

    assert cli.main(["synth", str(tmp_path / "m.json"), "--shape", "m", "--questions", "4"]) == 0
    data = json.loads((tmp_path / "m.json").read_text())
    assert len(data) == 4 and all(len(q["haystack_sessions"]) == 500 for q in data)
    assert {len(s) for q in data for s in q["haystack_sessions"]} == {10}
    pool = [int(i[5:]) for q in data for i in q["haystack_session_ids"] if i.startswith("pool_")]
    distractors = sum(500 - len(q["answer_session_ids"]) for q in data)
    # every distractor from the pool but for a pool session drawn twice in one history (~3 a history)
    assert distractors - 40 < len(pool) <= distractors and 40_000 < max(pool) < 43_000
    assert sum(len(q["answer_session_ids"]) for q in data) >= 7  # 90% of the questions have two
    assert cli.main(["synth", str(tmp_path / "o.json"), "--shape", "m", "--questions", "1", "--sessions", "30",
                     "--pool", "7"]) == 0
    q, = json.loads((tmp_path / "o.json").read_text())
    assert len(q["haystack_session_ids"]) == 30 and {i for i in q["haystack_session_ids"] if i.startswith("pool_")} \
        == {f"pool_{k:06d}" for k in range(7)}
    assert cli.main(["synth", str(tmp_path / "d.json")]) == 0
    assert (tmp_path / "d.json").read_bytes() == synth(
        tmp_path / "e.json", questions=20, sessions_per_history=40, turns_per_session=6, reuse_share=0.5,
        multi_session_share=0.3).read_bytes()
