"""Quirks of the published LongMemEval files, one small fixture each (tests/pipeline/data/fixtures/lme_*.json).

Found by scanning the oracle file (500 questions) and the S sample (22) in ../shared/data/longmemeval; the
repeated session is LongMemEval-S's (13 of 500 questions, not in these files). The M split has the same
format and goes through the same code.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memgas.pipeline.bank import Bank
from memgas.pipeline.data import longmemeval
from memgas.pipeline.data.common import Warnings
from memgas.pipeline.errors import DataError
from memgas.pipeline.ingest import ingest
from memgas.pipeline.stats import compute_stats

FIX = Path(__file__).parent / "fixtures"


def _load(name: str, **kw) -> tuple[list, Warnings]:
    w = Warnings(str(FIX / name), **kw)
    return list(longmemeval.load(FIX / name, w)), w


def test_repeated_session_is_kept_once_and_reported_once_per_history(tmp_path: Path, caplog) -> None:
    recs, w = _load("lme_repeated_session.json")
    # rep1 lists s_hello at positions 0 and 2; rep2 lists answer_dog at 1 and 2
    assert [[s["session_id"] for s in r.sessions] for r in recs] == [["s_hello", "answer_dog", "s_cat"],
                                                                      ["s_hello", "answer_dog"]]
    assert [s["position"] for s in recs[0].sessions] == [0, 1, 2]
    assert [len(r.repeats) for r in recs] == [1, 1]
    assert w.counts == {"repeated_session": 2}  # one warning per history
    assert "haystack_sessions[2]" in w.examples["repeated_session"][0]
    assert "haystack_sessions[0]" in w.examples["repeated_session"][0]
    # the evidence turn of the repeated evidence session is listed once
    assert recs[1].queries[0]["evidence_turn_ids"] == ["answer_dog:0"]
    s = ingest(FIX / "lme_repeated_session.json", "longmemeval", tmp_path / "b", progress=False)
    assert (s["sessions"], s["repeated_sessions"], s["warning_count"]) == (5, 2, 2)
    d = compute_stats(Bank(tmp_path / "b"))
    assert (d["sessions"], d["unique_sessions"], d["repeated_sessions"]) == (5, 3, 2)


def test_repeated_session_is_an_error_in_strict_mode() -> None:
    with pytest.raises(DataError, match=r"record 0 \(id=rep1\).*listed again.*\[repeated_session; strict mode\]"):
        _load("lme_repeated_session.json", strict=True)


def test_repeated_id_with_other_content_names_both_positions() -> None:
    with pytest.raises(DataError) as exc:
        _load("lme_repeated_id_other_content.json")
    msg = str(exc.value)
    assert "duplicate session id 's1'" in msg and "haystack_sessions[2]" in msg and "haystack_sessions[0]" in msg


def test_integer_answer_is_text() -> None:
    recs, w = _load("lme_integer_answer.json")
    assert recs[0].queries[0]["answer"] == "3" and not w.counts


def test_dates_out_of_order_are_kept_in_file_order_and_noted() -> None:
    recs, w = _load("lme_dates_out_of_order.json")
    assert [s["session_id"] for s in recs[0].sessions] == ["s_cat", "answer_dog", "s_hello"]  # the authors' order
    assert not w.counts  # notes, not warnings: strict mode does not reject the oracle file
    notes = w.notes()
    assert notes["sessions_not_in_date_order"]["histories"] == 1
    assert notes["sessions_after_question"]["count"] == 1
    _load("lme_dates_out_of_order.json", strict=True)


def test_has_answer_marks_on_any_role_and_evidence_without_marks() -> None:
    recs, _ = _load("lme_marks.json")
    q = recs[0].queries[0]
    assert q["evidence_session_ids"] == ["answer_a", "answer_b"]
    assert q["evidence_turn_ids"] == ["answer_a:0"]  # the assistant's mark; answer_b has none
    assert [t["role"] for t in recs[0].turns if t["has_answer"]] == ["assistant"]


def test_odd_turns_pair_by_position() -> None:
    recs, _ = _load("lme_odd_turns.json")
    r = recs[0]
    texts = [r.texts[p["text_hash"]] for p in r.pairs]
    assert texts == ["[assistant]: Welcome back.\n[user]: My dog is called Rex.", "[user]: He is a beagle."]
    assert r.queries[0]["evidence_turn_ids"] == ["answer_dog:0"]
