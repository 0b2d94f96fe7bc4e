"""``bench_cards_history.py`` on a tiny history (48 sessions, 8 appended), commands in-process and without Ray,
the IVF search past the first 128 nodes: the append's card-graph edges equal a fresh build's, which the script
checks and prints, and every command ran."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def test_a_tiny_history_runs_and_its_append_equals_a_fresh_build(tmp_path: Path, run_bench: Callable) -> None:
    rc, printed = run_bench("bench_cards_history", "--sessions", "48", "--append", "8", "--in-process", "--no-ray",
                             "--set", "association.ivf_exact_nodes=128", "--set", "association.ivf_nlist=2",
                             "--set", "association.ivf_nprobe=1", "--tmp", str(tmp_path), "--json",
                             str(tmp_path / "out.json"))
    out = json.loads((tmp_path / "out.json").read_text())
    assert rc == 0 and out["edges_equal"] is True
    assert "append's card_graph_edges == fresh build's: True" in printed
    assert set(out["index"]["stages"]) >= {"cards", "card-graph-associate"}
    assert set(out["append_index"]["stages"]) >= {"card-graph-associate"}
    assert set(out["answer"]["stages"]) >= {"card-graph-rank", "evaluate"}
    assert 0 < out["ratio"]
