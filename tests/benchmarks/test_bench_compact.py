"""``bench_compact.py`` on tiny tables, as a user runs it (a process, its own children): the made table and
an append both end with the compactions agreeing, so the bench cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_compact.py"


def _run(tmp_path: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, str(BENCH), "--work", str(tmp_path / "work"), *args],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not (tmp_path / "work").exists()  # the bench cleans up after itself
    return proc.stdout


def test_a_made_table_compacts_to_the_same_bytes_both_ways(tmp_path: Path) -> None:
    out = _run(tmp_path, "--parts", "5", "--rows", "40")
    assert "the same rows: yes; the same bytes: yes" in out and "| streamed | 200 |" in out


def test_an_append_is_merged_beside_the_large_part_and_reads_the_same_rows(tmp_path: Path) -> None:
    out = _run(tmp_path, "--parts", "4", "--rows", "100", "--append-parts", "2", "--append-rows", "10")
    assert "| streamed | 420 | 2 |" in out and "| untiered | 420 | 1 |" in out
    assert out.count("the same rows: yes") == 2
