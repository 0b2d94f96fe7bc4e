"""The library-level benchmark scripts at tiny sizes, in this process: each one's own correctness check on its
inputs holds and it prints its comparison (ratio) line, so that no script rots. Not their speed."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path


Run = Callable[..., tuple[object, str]]


def test_association_agrees_with_the_authors_loop(run_bench: Run) -> None:
    _, out = run_bench("bench_association", "--sessions", "12", "--queries", "2", "--skip-locomo")
    # 48 nodes: every row past the first 20 is compared with the per-node scikit-learn GMM
    assert re.search(r"LME-m-sized synthetic \(1 history\) +28 +\d+ .* \d+x +28/28 +\(100\.00%\)", out), out
    assert re.search(r"blocked causal [\d.]+ s \([\d.]+x\), identical candidates: True", out), out
    assert re.search(r"authors' loop .* = \d+x; same top-10 for 100% of questions", out), out


def test_push_ppr_agrees_with_the_exact_ppr(run_bench: Run) -> None:
    rc, out = run_bench("bench_ppr_push", "--skip-lme", "--sessions", "30", "--queries", "4",
                        "--kernel-nodes", "2000", "--eps", "1e-6")
    assert rc == 0, out
    assert "LoCoMo: 10 histories, 500 questions" in out
    assert re.search(r"eps 1e-08: top-10 equal memgas 500/500 .* push/exact [\d.]+", out), out
    assert re.search(r"synthetic 30 sessions: .*\n  eps 1e-06: top-10 equal memgas 4/4", out), out
    assert re.search(r"kernel only: random graph, 2000 nodes.*\n  eps 1e-08: push .* push/exact [\d.]+", out), out
    assert out.rstrip().endswith("goal (>= 99.9% top-10 equal on LoCoMo and the LongMemEval-S sample) met")


def test_sparse_exact_packed_equals_per_tile(run_bench: Run) -> None:
    _, out = run_bench("bench_sparse_exact", "--nodes", "4000", "--window", "1000", "--sample", "64")
    assert re.search(r"per-tile [\d.]+ s  packed [\d.]+ s  ratio [\d.]+x  identical=True", out), out


def test_ivf_association_recall_and_timing(run_bench: Run) -> None:
    _, out = run_bench("bench_ivf_association", "--synthetic", "300", "--exact-nodes", "512", "--nlist", "4",
                       "--nprobe", "1,2", "--sample", "128")
    lines = [json.loads(x) for x in out.splitlines()]
    assert lines[0] == {"source": "synthetic", "sessions": 300}
    assert [(r["nprobe"], r["rows"], r["sampled"]) for r in lines[1:]] == [(1, 688, 128), (2, 688, 128)]
    assert 0 < lines[1]["recall"] <= lines[2]["recall"] <= 1  # more lists searched: no fewer exact candidates
    _, out = run_bench("bench_ivf_association", "--timing", "512", "--rows", "64", "--nlist", "4", "--nprobe", "1")
    (r,) = [json.loads(x) for x in out.splitlines()]
    assert r["prefix_nodes"] == 512 and r["rows"] == 64 and r["exact_s_per_row"] > 0 and r["ivf_s_per_row"] >= 0


def test_ivf_units_cut_run_equals_one_unit(run_bench: Run) -> None:
    from memgas.pipeline.association import segments

    before = segments.IVF_UNIT_SESSIONS
    _, out = run_bench("bench_ivf_units", "--sessions", "200", "--unit", "100", "--exact-nodes", "400",
                       "--nlist", "4", "--nprobe", "1")
    assert "one unit {'units': [[0, 200]]" in out and "units of 100 {'units': [[0, 100], [100, 200]]" in out
    assert out.rstrip().endswith("edges equal: True saved index equal: True")
    assert segments.IVF_UNIT_SESSIONS == before  # the script puts the module's value back


def test_huge_history_library_mode(run_bench: Run, tmp_path: Path) -> None:
    """Each size in a child process (its own peak RSS): one child of 300 sessions, HNSW against exact."""
    _, out = run_bench("bench_huge_history", "--sizes", "300", "--append", "40", "--queries", "4", "--topics", "20",
                       "--sample-tiles", "2", "--json", str(tmp_path / "r.json"))
    (r,) = json.loads((tmp_path / "r.json").read_text())
    assert r["sessions"] == 300 and r["search"] == "hnsw" and r["exact_edges"] > 0
    assert r["append_split_identical"] is True and r["query"]["top10_same_as_score_with_edges"] is True
    assert re.search(r"300 sessions: approx vs exact build x[\d.]+ \(measured\); append split identical: True; "
                     r"append == fresh build: None; query top-10 == score_with_edges: True", out), out


def test_query_scan_three_ways_give_the_same_bits(run_bench: Run, tmp_path: Path) -> None:
    """5,000 sessions are 20,000 node rows: two similarity spans and two spill files."""
    rc, out = run_bench("bench_query_scan", "--sessions", "5000", "--queries", "2", "--threads", "2",
                        "--tmp", str(tmp_path), "--json", str(tmp_path / "r.json"))
    assert rc == 0 and "bits identical in all three ways: True" in out
    assert re.search(r"now, 2 threads +[\d.]+ +[\d.]+ +[\d.]+x", out), out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["node_rows"] == 20000 and r["bits_identical"] is True
    assert len({r[w]["digest"] for w in ("before", "now, 1 thread", "now, 2 threads")}) == 1
    assert not list(tmp_path.glob("bench-query-scan-*"))  # its block files are deleted


def test_stream_ingest_in_a_child(run_bench: Run, tmp_path: Path) -> None:
    _, out = run_bench("bench_stream", "--target-mb", "0.05", "--sessions", "3", "--turns", "2",
                       "--workdir", str(tmp_path))
    r = json.loads(out.splitlines()[-1])
    assert r["histories"] == r["queries"] == r["questions"] and r["sessions"] == 3 * r["histories"]
    assert r["unique_sessions"] <= r["sessions"] and r["peak_rss_mb"] > r["rss_after_import_mb"] > 0
    assert r["peak_rss_over_file"] > 0
    assert not list(tmp_path.iterdir())  # the file and the bank are removed without --keep


def test_every_script_runs_in_the_suite() -> None:
    """Every script in benchmarks/ is named by a test that runs it (here, in the other files of this folder, and
    the GPU check's CPU mode and no-device refusal in tests/test_gpu_stack.py)."""
    tests = Path(__file__).resolve().parents[1]
    text = "".join(p.read_text() for p in tests.rglob("test_*.py"))
    scripts = [p for p in (tests.parent / "benchmarks").iterdir() if p.suffix in (".py", ".sh")]
    assert len(scripts) > 10
    assert sorted(p.name for p in scripts if (p.stem if p.suffix == ".py" else p.name) not in text) == []


def test_card_graph_associate_blocked_equals_dense(run_bench: Run) -> None:
    _, out = run_bench("bench_card_graph_associate", "--histories", "2", "--sessions", "40", "--cards", "6",
                       "--dim", "32")
    assert re.search(r"histories=2 sessions=40 nodes/history=\d+ cards/history=\d+ dim=32 k=30", out), out
    assert re.search(r"dense [\d.]+ CPU s/history  blocked [\d.]+ CPU s/history  ratio [\d.]+x  identical=True "
                     r"edges_identical=True", out), out
