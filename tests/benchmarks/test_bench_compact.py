"""``bench_compact.py`` on tiny tables, in this process (each compaction still runs in a child of its own): the
made table and an append both end with the compactions agreeing, so the bench cannot rot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

Run = Callable[..., tuple[object, str]]


def _run(run_bench: Run, tmp_path: Path, *args: str) -> str:
    _, out = run_bench("bench_compact", "--work", str(tmp_path / "work"), *args)
    assert not (tmp_path / "work").exists()  # the bench cleans up after itself
    return out


def test_a_made_table_compacts_to_the_same_bytes_both_ways(run_bench: Run, tmp_path: Path) -> None:
    out = _run(run_bench, tmp_path, "--parts", "5", "--rows", "40")
    assert "the same rows: yes; the same bytes: yes" in out and "| streamed | 200 |" in out


def test_an_append_is_merged_beside_the_large_part_and_reads_the_same_rows(run_bench: Run, tmp_path: Path) -> None:
    out = _run(run_bench, tmp_path, "--parts", "4", "--rows", "100", "--append-parts", "2", "--append-rows", "10")
    assert "| streamed | 420 | 2 |" in out and "| untiered | 420 | 1 |" in out
    assert out.count("the same rows: yes") == 2
