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
    session_row = next(line for line in report.splitlines() if line.startswith("| session |"))
    assert session_row.split("|")[4].strip() == "30.0"
    assert "bertscore skipped" in report
    assert "| temporal | 2 | 25.0 |" in report
    for png in ("recall_at_k.png", "recall_by_type.png", "stage_times.png"):
        assert (tmp_path / png).stat().st_size > 1000
        assert f"({png})" in report


def test_every_method_has_its_own_line_coloured_by_family(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's 15 methods and memgas-cards: each line of the recall plot has its own (colour, marker, dash), and
    the colour says the family (the default cycle has ten colours: session and justmem were both blue)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    from memgas.jobs.report import plot_run
    from memgas.pipeline.methods import KNOWN_METHOD_NAMES, METHODS

    overall = _metrics(0.6)["retrieval"]["session"]["memgas"]
    metrics = {"retrieval": {"session": {m: overall for m in KNOWN_METHOD_NAMES}}}
    figures: list = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figures to read their lines
    plot_run(metrics, tmp_path)
    monkeypatch.undo()
    lines = next(f.axes[0].get_lines() for f in figures if f.axes[0].get_title() == "Session-level recall by method")
    styles = {line.get_label(): (to_rgba(line.get_color()), line.get_marker(), line.get_linestyle()) for line in lines}
    assert sorted(styles) == sorted(KNOWN_METHOD_NAMES)
    assert len(set(styles.values())) == len(KNOWN_METHOD_NAMES)
    # a family's shades never meet another family's: red > blue for JustMem's oranges, green highest for cards
    hue = {m: max(range(3), key=lambda c, m=m: styles[m][0][c]) for m in styles}
    assert {m: hue[m] for m in styles} == {m: {"memgas": 2, "justmem": 0, "memgas-cards": 1}[METHODS[m].family]
                                           for m in styles}
    for f in figures:
        plt.close(f)


def test_plots_off_removes_the_earlier_runs_plots_and_report_draws_them_later(tmp_path: Path) -> None:
    """evaluation.plots=false: no PNG, and the previous run's PNGs (which no longer match the report) are gone;
    `memgas report` on the directory draws them from metrics.json."""
    from memgas.jobs.cli import main

    (tmp_path / "metrics.json").write_text(json.dumps(_metrics(0.6)))
    write_report(tmp_path)
    assert (tmp_path / "stage_times.png").exists()
    (tmp_path / "mine.png").write_bytes(b"not memgas's")
    report = write_report(tmp_path, plots=False).read_text()
    assert not any((tmp_path / png).exists() for png in ("recall_at_k.png", "recall_by_type.png", "stage_times.png"))
    assert ".png)" not in report and "`evaluation.plots=false`" in report
    assert (tmp_path / "mine.png").read_bytes() == b"not memgas's"
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "stage_times.png").stat().st_size > 1000
    assert "(stage_times.png)" in (tmp_path / "report.md").read_text()


def test_report_has_tokens_per_granularity(tmp_path: Path) -> None:
    m = _metrics(0.6)
    m["encoding"] = {"session": {"texts": 4, "truncated": 3, "tokens": 300, "tokens_dropped": 100},
                     "question": {"texts": 2, "truncated": 0, "tokens": 20, "tokens_dropped": 0},
                     "hybrid": {"texts": 1, "truncated": 0, "tokens": None, "tokens_dropped": None}}
    (tmp_path / "metrics.json").write_text(json.dumps(m))
    report = write_report(tmp_path).read_text()
    assert "## Encoding (tokens per granularity)" in report
    assert "| session | 4 | 3 | 300 | 100 | 25.0% |" in report
    assert "| question | 2 | 0 | 20 | 0 | 0.0% |" in report
    assert "| hybrid | 1 | 0 | ? | ? | - |" in report  # unknown counts are never guessed


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


def _no_ground_truth() -> dict:
    """What a Long-MT-Bench+ run records: no question has evidence, so every retrieval metric is NaN/null."""
    nan = float("nan")
    overall = {**{f"recall_all@{k}": nan for k in (1, 3, 5, 10)}, **{f"ndcg_any@{k}": None for k in (1, 3, 5, 10)}, "n": 0}
    return {
        "run": {"name": "lmt", "wall_s": None},
        "dataset": {"path": "/d/longmtbench.json", "sha256": "c" * 64},
        "retrieval": {"session": {"memgas": {"overall": overall, "by_type": {}, "n_evaluated": 0,
                                             "skipped": {"no_evidence": 12}}}},
        "qa": {"memgas": {"overall": {"f1": 0.1}, "by_type": {"long-mt-bench": {"f1": 0.1, "n": 12}}, "n": 12}},
        "stages": {"rank": {"wall_s": 1.0, "items": None}},
    }


def test_report_of_a_run_without_retrieval_ground_truth(tmp_path: Path) -> None:
    (tmp_path / "metrics.json").write_text(json.dumps(_no_ground_truth()))
    report = write_report(tmp_path).read_text()
    row = next(line for line in report.splitlines() if line.startswith("| memgas |"))
    assert "–" in row and "nan" not in row.lower()
    assert "| long-mt-bench | 12 | 10.0 |" in report
    assert not (tmp_path / "recall_at_k.png").exists()  # nothing to draw
    assert (tmp_path / "stage_times.png").exists()


def test_report_of_a_dataset_with_no_histories(tmp_path: Path) -> None:
    (tmp_path / "metrics.json").write_text(json.dumps({"run": {"name": "empty"}, "retrieval": {"session": {}},
                                                       "qa": {}, "stages": {}, "latency": {}}))
    report = write_report(tmp_path).read_text()
    assert report.startswith("# memgas report: empty")
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("content, needle", [("{oops", "corrupt metrics.json"), ("[1]", "expected a JSON object"),
                                             (b"\xff\xfe", "corrupt metrics.json")])
def test_corrupt_metrics_is_a_clear_error(tmp_path: Path, content, needle: str) -> None:
    f = tmp_path / "metrics.json"
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(MemgasError, match=needle):
        write_report(tmp_path)
    with pytest.raises(MemgasError, match=needle):
        compare_runs([tmp_path, tmp_path])


def test_compare_says_when_datasets_differ(tmp_path: Path) -> None:
    for name, sha in (("a", "a" * 64), ("b", "a" * 64), ("c", "b" * 64), ("d", None)):
        d = tmp_path / name
        d.mkdir()
        m = _metrics(0.5)
        if sha:
            m["dataset"] = {"path": f"/data/{name}.json", "sha256": sha}
        (d / "metrics.json").write_text(json.dumps(m))
    same = compare_runs([tmp_path / "a", tmp_path / "b"])
    assert "Warning" not in same and "Note" not in same
    differ = compare_runs([tmp_path / "a", tmp_path / "c"])
    assert "different datasets" in differ and "c.json (sha256 bbbbbbbbbbbb)" in differ
    unknown = compare_runs([tmp_path / "a", tmp_path / "d"])
    assert "cannot be checked" in unknown
    # a run of a dataset without ground truth compares without crashing
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "metrics.json").write_text(json.dumps(_no_ground_truth()))
    text = compare_runs([tmp_path / "a", tmp_path / "e"])
    assert "| e | memgas | – |" in text and "different datasets" in text


def test_report_names_questions_left_out_of_the_evidence_recall() -> None:
    """A bank appended to after an ingest that kept no evidence turns: its old questions have none; the
    report says how many the reader's evidence recall leaves out (it used to leave them out silently)."""
    from memgas.jobs.report import render_markdown

    overall = {"recall_all@5": 0.5}
    reader = {"overall": {"evidence_recall": 0.5}, "by_type": {}, "n_evaluated": 2, "skipped": {}, "cut": 0,
              "not_measured": 7}
    metrics = {"retrieval": {"session": {"memgas": {"overall": overall, "by_type": {}, "n_evaluated": 2,
                                                    "skipped": {}, "reader": reader}}},
               "notes": {"reader_evidence": "what is measured"}}
    text = render_markdown(metrics, {})
    assert "leaves out 7 questions ingested before the bank kept evidence turns" in text
    reader["not_measured"] = 0
    assert "leaves out" not in render_markdown(metrics, {})
