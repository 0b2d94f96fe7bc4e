"""compute_stats / format_stats: exact counts, derived outside memgas.

The sample numbers were counted from the raw JSON with a dozen lines of plain Python (render each
utterance as "[role]: content", pair consecutive utterances, join; count distinct session texts, the
utterances and pairs of distinct sessions, distinct session+pair texts, characters); the tiny fixture's
numbers can be checked by reading it.
"""

from __future__ import annotations

import json
from pathlib import Path

from memgas.pipeline.bank import Bank
from memgas.pipeline.ingest import ingest
from memgas.pipeline.stats import compute_stats, format_stats
from tests.conftest import SAMPLE_COUNTS

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample"


def test_stats_locomo_sample(tmp_path: Path) -> None:
    ingest(SAMPLE / "locomo_sample.json", "locomo", tmp_path / "b", progress=False)
    d = compute_stats(Bank(tmp_path / "b"))
    assert (d["histories"], d["sessions"], d["unique_sessions"], d["dedup_ratio"]) == (SAMPLE_COUNTS["histories"], SAMPLE_COUNTS["sessions"], SAMPLE_COUNTS["sessions"], 1.0)
    assert (d["turns"], d["pairs"], d["texts"]) == (788, 402, 440)
    assert d["queries"] == SAMPLE_COUNTS["queries"]
    assert d["queries_by_type"] == {"adversarial": 71, "multi-hop": 43, "open-domain": 13, "single-hop": 114, "temporal": 63}
    assert (d["queries_with_evidence"], d["queries_with_turn_evidence"], d["abstentions"]) == (302, 302, 0)
    # 124,126 characters of session text (conv-26: 71,886, conv-30: 52,240), no session shared
    assert d["tokens_unique_sessions"] == d["tokens_session_references"] == round(124126 / 4) == 31032
    assert (d["tokens_per_history_mean"], d["tokens_per_history_max"]) == (round(124126 / 8), round(71886 / 4))
    assert d["repeated_sessions"] == 0 and d["ingest_warnings"] == 0
    table = format_stats(d)
    assert "unique sessions" in table and "chars/4" in table and "31,032" in table


def test_stats_lme_sample(tmp_path: Path) -> None:
    ingest(SAMPLE / "longmemeval_s_sample3.json", "longmemeval", tmp_path / "b", progress=False)
    d = compute_stats(Bank(tmp_path / "b"))
    # 142 haystack entries, one session shared by two of the three questions
    assert (d["histories"], d["sessions"], d["unique_sessions"]) == (3, 142, 141)
    assert d["dedup_ratio"] == round(142 / 141, 4) and d["sessions_per_history"] == round(142 / 3, 2)
    assert (d["turns"], d["pairs"], d["texts"]) == (1578, 795, 927)
    assert d["queries_by_type"] == {"knowledge-update": 1, "multi-session": 1, "temporal-reasoning": 1}
    # every question names evidence sessions; the abstention question's have no has_answer marks
    assert (d["queries"], d["abstentions"], d["queries_with_evidence"], d["queries_with_turn_evidence"]) == (3, 1, 3, 2)
    assert d["tokens_unique_sessions"] == round(1459768 / 4)
    assert d["tokens_session_references"] == round(1472307 / 4)
    assert d["tokens_per_history_mean"] == round(1472307 / 3 / 4) and d["tokens_per_history_max"] == round(497408 / 4)


def _turns(*pairs: str) -> list[dict]:
    out = []
    for i, text in enumerate(pairs):
        out.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return out


def test_stats_hand_counted(tmp_path: Path) -> None:
    """Two histories: h1 = [a, b, a again (a repeat)], h2 = [b, c]; session a has 3 utterances, b 2, c 1."""
    a, b, c = _turns("x1", "x2", "x3"), _turns("y1", "y2"), _turns("z1")
    lines = [
        {"history_id": "h1", "sessions": [{"session_id": "a", "turns": a}, {"session_id": "b", "turns": b},
                                          {"session_id": "a", "turns": a}],
         "questions": [{"query_id": "q1", "question": "?", "evidence_session_ids": ["a"]},
                       {"query_id": "q2_abs", "question": "?"}]},
        {"history_id": "h2", "sessions": [{"session_id": "b", "turns": b}, {"session_id": "c", "turns": c}],
         "questions": [{"query_id": "q3", "question": "?", "question_type": "t"}]},
    ]
    f = tmp_path / "h.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = ingest(f, "jsonl", tmp_path / "b", progress=False)
    assert s["repeated_sessions"] == 1 and s["warning_count"] == 1
    d = compute_stats(Bank(tmp_path / "b"))
    assert (d["histories"], d["sessions"], d["unique_sessions"], d["repeated_sessions"]) == (2, 4, 3, 1)
    assert d["dedup_ratio"] == round(4 / 3, 4)
    assert (d["turns"], d["pairs"]) == (3 + 2 + 1, 2 + 1 + 1)
    # texts: 3 session texts + pairs ("x1\nx2", "x3", "y1\ny2" == session b's text, "z1" == session c's text)
    assert d["texts"] == 3 + 2
    assert d["queries"] == 3 and d["abstentions"] == 1 and d["queries_with_evidence"] == 1
    assert d["queries_by_type"] == {"t": 1, "unknown": 2}
    assert d["ingest_warnings"] == 1
    len_a = len("[user]: x1\n[assistant]: x2\n[user]: x3")
    len_b = len("[user]: y1\n[assistant]: y2")
    len_c = len("[user]: z1")
    assert d["tokens_unique_sessions"] == round((len_a + len_b + len_c) / 4)
    assert d["tokens_session_references"] == round((len_a + 2 * len_b + len_c) / 4)
    assert "repeats dropped at ingest" in format_stats(d)


def test_stats_empty_bank(tmp_path: Path) -> None:
    d = compute_stats(Bank.create(tmp_path / "b"))
    assert d["histories"] == 0 and d["sessions"] == 0 and d["dedup_ratio"] is None
    assert d["tokens_per_history_mean"] == 0 and d["queries_by_type"] == {}
    assert "histories" in format_stats(d)
