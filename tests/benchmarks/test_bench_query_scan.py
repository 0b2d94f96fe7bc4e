"""``bench_query_scan.py`` on a small history, as a user runs it (a process): the three ways agree bit for bit,
so the bench cannot rot. 5,000 sessions are 20,000 node rows: two similarity spans and two spill files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_query_scan.py"


def test_the_three_scans_give_the_same_bits(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, str(BENCH), "--sessions", "5000", "--queries", "2", "--threads", "2",
                           "--tmp", str(tmp_path), "--json", str(tmp_path / "r.json")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "bits identical in all three ways: True" in proc.stdout
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["node_rows"] == 20000 and r["bits_identical"] is True
    assert len({r[w]["digest"] for w in ("before", "now, 1 thread", "now, 2 threads")}) == 1
    assert not list(tmp_path.glob("bench-query-scan-*"))  # its block files are deleted
