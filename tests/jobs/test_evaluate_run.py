"""Evaluation of a run (jobs/evaluate_run.py): what it logs."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pytest

from memgas.jobs.evaluate_run import evaluate_run
from memgas.pipeline.bank import Bank
from memgas.pipeline.schema import QUERIES
from tests.jobs.test_stages import _base


def test_the_questions_left_out_of_retrieval_are_logged_once_per_run(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Every method is scored over the same questions: the line that counts the skipped ones comes once, not
    once per method (the demo printed it nine times)."""
    bank = Bank.create(tmp_path / "bank")
    q = {"history_id": "h", "question": "?", "answer": "a", "question_type": "temporal", "evidence_turn_ids": []}
    bank.write("queries", pa.Table.from_pylist([
        {**q, "query_id": "q1", "evidence_session_ids": ["s1"], "is_abstention": False},
        {**q, "query_id": "q2", "evidence_session_ids": ["s1"], "is_abstention": True},
        {**q, "query_id": "q3", "evidence_session_ids": [], "is_abstention": False}], schema=QUERIES))
    cfg = _base(tmp_path, **{"retrieval.methods": ["session", "turn", "memgas"]})
    with caplog.at_level(logging.INFO):
        out = evaluate_run(cfg, bank, Bank.create(tmp_path / "results"))
    assert [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()] == [
        "retrieval eval (session level): skipped {'abstention': 1, 'no_evidence': 1}"]
    assert [m["skipped"] for m in out["retrieval"]["session"].values()] == [{"abstention": 1, "no_evidence": 1}] * 3
