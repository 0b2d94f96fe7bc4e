"""The benchmark scripts that run the CPU models (MiniLM, the LLM-free generator) at tiny sizes, in this process:
each one's own correctness check holds and it prints its comparison (ratio) line. Not their speed."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

Run = Callable[..., tuple[object, str]]


def test_append_index_equals_a_fresh_index(run_bench: Run) -> None:
    rc, out = run_bench("bench_append_index", "--sessions", "8", "--append", "2", "--turns", "2")
    assert rc == 0, out
    assert "segments after append: [('h0', 0, 6), ('h0', 6, 8)]; fresh: [('h0', 0, 8)]" in out
    assert re.search(r"\ntotal +[\d.]+s +[\d.]+s +[\d.]+s +[\d.na]+x\n", out), out
    assert re.search(r"edges equal \(grown vs fresh, exact\): True \([\d,]+ edges\)", out), out


def test_answer_after_an_append_ranks_only_the_changed_history(run_bench: Run) -> None:
    rc, out = run_bench("bench_answer_append", "--histories", "3", "--sessions", "3", "--append", "1", "--turns", "2")
    assert rc == 0, out
    assert re.search(r"after the append, same run dir +[\d.]+ +[\d.]+  1/2 histories, 1/2 questions", out), out
    assert re.search(r"after the append, new run dir +[\d.]+ +[\d.]+  3/0 histories, 3/0 questions", out), out
    assert re.search(r"rank: new run dir / same run dir = [\d.]+x; command: [\d.]+x", out), out
    assert "rankings and retrieval metrics equal (same run dir vs new): True" in out


def test_encoder_bucketed_equals_sentence_transformers(run_bench: Run, locomo_tiny: Path) -> None:
    _, out = run_bench("bench_encoder", "--locomo", str(locomo_tiny), "--limit", "8")
    m = re.search(r"speed ratio \(ours / ST\): [\d.]+x   max \|diff\| of embeddings: ([\d.e+-]+)", out)
    assert m and float(m.group(1)) < 1e-5, out
    assert "texts: 8 (LoCoMo turn pairs + sessions)" in out


def test_generators_llm_free(run_bench: Run, locomo_tiny: Path) -> None:
    _, out = run_bench("bench_generators", "--skip-llm", "--n", "2", "--data", str(locomo_tiny))
    rows = [x for x in out.splitlines() if x.startswith("| llm-free")]
    assert [r.split(" | ")[1:3] for r in rows] == [["100%", "100%"]] * 2, out  # every summary and list usable
    assert all(0 < float(r.split(" | ")[6]) <= 1 for r in rows), out  # cosine to LoCoMo's own summary


def test_cpu_quality_one_setting(run_bench: Run, locomo_tiny: Path) -> None:
    _, out = run_bench("cpu_quality", "--data", str(locomo_tiny), "--gens", "tfidf", "--encs", "torch:truncate",
                       "--methods", "session,memgas", "--cache", "")
    assert "| generator | encoder | session | memgas |" in out
    assert re.search(r"\| tfidf \| torch:truncate \| [\d.]+/[\d.]+/100\.0 \| [\d.]+/[\d.]+/100\.0 \|", out), out
    assert "locomo session level, locomo_tiny.json; generation ms/session: tfidf " in out
