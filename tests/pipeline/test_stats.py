"""compute_stats / format_stats on banks ingested from the bundled sample."""

from __future__ import annotations

from pathlib import Path

from memgas.pipeline.bank import Bank
from memgas.pipeline.ingest import ingest
from memgas.pipeline.stats import compute_stats, format_stats

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample"


def test_stats_locomo_sample(tmp_path: Path) -> None:
    s = ingest(SAMPLE / "locomo_sample.json", "locomo", tmp_path / "b", progress=False)
    d = compute_stats(Bank(tmp_path / "b"))
    assert d["histories"] == 2 and d["sessions"] == d["unique_sessions"] == 38 and d["dedup_ratio"] == 1.0
    assert d["turns"] == s["turns"] and d["pairs"] == s["pairs"] and d["queries"] == 304
    assert set(d["queries_by_type"]) <= {"multi-hop", "temporal", "open-domain", "single-hop", "adversarial"}
    assert sum(d["queries_by_type"].values()) == 304
    assert d["tokens_unique_sessions"] == d["tokens_session_references"] > 10_000
    table = format_stats(d)
    assert "unique sessions" in table and "chars/4" in table


def test_stats_lme_sample(tmp_path: Path) -> None:
    ingest(SAMPLE / "longmemeval_s_sample3.json", "longmemeval", tmp_path / "b", progress=False)
    d = compute_stats(Bank(tmp_path / "b"))
    assert d["histories"] == 3 and d["queries"] == 3 and d["abstentions"] == 1
    assert d["queries_with_evidence"] == 3
    assert d["sessions"] >= d["unique_sessions"] and d["dedup_ratio"] >= 1.0
    assert d["tokens_per_history_max"] >= d["tokens_per_history_mean"] > 0


def test_stats_empty_bank(tmp_path: Path) -> None:
    d = compute_stats(Bank.create(tmp_path / "b"))
    assert d["histories"] == 0 and d["dedup_ratio"] is None
    assert "histories" in format_stats(d)
