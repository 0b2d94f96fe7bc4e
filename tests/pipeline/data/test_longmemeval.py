"""LongMemEval loader: question counts, evidence from answer_session_ids and has_answer, sharing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memgas.pipeline.data import longmemeval
from memgas.pipeline.data.common import Warnings, pair_up, render_utterance

REPO = Path(__file__).resolve().parents[3]
LME = REPO.parent / "shared" / "data" / "longmemeval"
SAMPLE3 = REPO / "data" / "sample" / "longmemeval_s_sample3.json"


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"LongMemEval data not found at {path}")
    return path


def test_oracle_500() -> None:
    path = _need(LME / "longmemeval_oracle.json")
    w = Warnings(str(path))
    recs = list(longmemeval.load(path, w))
    assert len(recs) == 500 and not w.counts
    qs = [r.queries[0] for r in recs]
    assert sum(q["is_abstention"] for q in qs) == 30
    assert all(q["evidence_session_ids"] for q in qs)
    assert all(isinstance(q["answer"], str) for q in qs)


def test_s_sample_22_and_dedup() -> None:
    path = _need(LME / "longmemeval_s_sample.json")
    recs = list(longmemeval.load(path, Warnings(str(path))))
    assert len(recs) == 22
    refs = sum(len(r.sessions) for r in recs)
    unique = len({s["text_hash"] for r in recs for s in r.sessions})
    # independent count of unique rendered sessions straight from the JSON
    raw = json.loads(path.read_text())
    expect_unique = len(
        {"\n".join(pair_up([render_utterance(t["role"], t["content"]) for t in s])) for q in raw for s in q["haystack_sessions"]}
    )
    assert refs == sum(len(q["haystack_session_ids"]) for q in raw) == 1087
    assert unique == expect_unique
    assert refs / unique >= 1.0


def test_sample3_evidence_and_turns() -> None:
    recs = list(longmemeval.load(SAMPLE3, Warnings(str(SAMPLE3))))
    raw = json.loads(SAMPLE3.read_text())
    assert [r.history_id for r in recs] == [q["question_id"] for q in raw]
    for r, q in zip(recs, raw):
        query = r.queries[0]
        assert query["evidence_session_ids"] == q["answer_session_ids"]
        assert query["is_abstention"] == q["question_id"].endswith("_abs")
        expect = []
        for sid, sess in zip(q["haystack_session_ids"], q["haystack_sessions"]):
            for i, t in enumerate(sess):
                if t.get("has_answer") and f"{sid}:{i // 2}" not in expect:
                    expect.append(f"{sid}:{i // 2}")
        assert query["evidence_turn_ids"] == expect
        # utterance level: every has_answer utterance, "session_id:turn_index"
        utt = [f"{sid}:{i}" for sid, sess in zip(q["haystack_session_ids"], q["haystack_sessions"])
               for i, t in enumerate(sess) if t.get("has_answer")]
        assert query["evidence_utterance_ids"] == list(dict.fromkeys(utt))
        assert [s["session_id"] for s in r.sessions] == q["haystack_session_ids"]  # answer_ prefix kept
        assert r.sessions[0]["date_raw"] == q["haystack_dates"][0] and r.sessions[0]["date"] is not None
    marked = [t for r in recs for t in r.turns if t["has_answer"]]
    assert marked and all(t["role"] in ("user", "assistant") for t in marked)
    # session text = pairs joined by newlines; an odd last utterance is a pair by itself
    r = recs[0]
    s = r.sessions[0]
    pairs = [p for p in r.pairs if p["session_hash"] == s["text_hash"]]
    assert r.texts[s["text_hash"]] == "\n".join(r.texts[p["text_hash"]] for p in pairs)
    assert len(pairs) == (s["n_turns"] + 1) // 2
