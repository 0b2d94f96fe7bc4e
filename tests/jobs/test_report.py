"""Reports: markdown tables and PNG plots from metrics.json, and the side-by-side comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memgas.jobs.report import compare_runs, write_report
from memgas.pipeline.errors import MemgasError


def _metrics(recall5: float) -> dict:
    overall = {f"recall_all@{k}": min(1.0, recall5 * k / 5) for k in (1, 3, 5, 10)}
    overall.update({f"recall_any@{k}": 1.0 for k in (1, 3, 5, 10)})
    overall.update({f"ndcg_any@{k}": 0.5 for k in (1, 3, 5, 10)})
    return {
        "run": {"name": "t", "encoder": "enc", "wall_s": 1.0},
        "retrieval": {"session": {
            "memgas": {"overall": overall, "by_type": {"temporal": {**overall, "n": 3}}, "n_evaluated": 3,
                       "skipped": {"abstention": 1}},
            "session": {"overall": {**overall, "recall_all@5": recall5 / 2}, "by_type": {}, "n_evaluated": 3,
                        "skipped": {}},
        }},
        "qa": {"memgas": {"overall": {"f1": 0.25}, "by_type": {"temporal": {"f1": 0.25, "n": 2.0}}, "n": 2,
                          "notes": ["bertscore skipped: disabled"]}},
        "stages": {"encode": {"wall_s": 2.0, "cpu_s": 3.0, "peak_rss_mb": 100, "items": 10, "items_per_s": 5.0}},
        "latency": {"ranking": {"p50_ms": 1.5, "p95_ms": 3.0, "n": 10}},
    }


def test_write_report_tables_and_plots(tmp_path: Path) -> None:
    (tmp_path / "metrics.json").write_text(json.dumps(_metrics(0.6)))
    report = write_report(tmp_path).read_text()
    # recall_all@5 of memgas is 0.6 -> "60.0"; the session baseline 0.3 -> "30.0"
    row = next(line for line in report.splitlines() if line.startswith("| memgas |"))
    assert row.split("|")[4].strip() == "60.0"
    assert "| session |" in report and "30.0" in report
    assert "bertscore skipped" in report
    assert "| temporal | 2 | 25.0 |" in report
    for png in ("recall_at_k.png", "recall_by_type.png", "stage_times.png"):
        assert (tmp_path / png).stat().st_size > 1000
        assert f"({png})" in report


def test_compare_runs_side_by_side(tmp_path: Path) -> None:
    for name, r in (("a", 0.6), ("b", 0.8)):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.json").write_text(json.dumps(_metrics(r)))
    text = compare_runs([tmp_path / "a", tmp_path / "b"])
    rows = [line for line in text.splitlines() if line.startswith("| a |") or line.startswith("| b |")]
    assert len(rows) == 4  # 2 runs x 2 methods
    assert any(line.startswith("| b | memgas |") and "| 80.0 |" in line for line in rows)


def test_report_without_metrics_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(MemgasError, match="no metrics.json"):
        write_report(tmp_path)
