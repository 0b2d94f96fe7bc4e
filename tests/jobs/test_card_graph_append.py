"""memgas-cards' edges after an append: segmented like MemGAS's, so ``memgas index`` after ``memgas ingest
--append`` associates only the new sessions' rows, and the edges (and memgas-cards' rankings) equal those of one
build over everything, byte for byte. Through the CLI in-process, no Ray, the LLM-free generator and card
extractor and the synthetic encoder (vectors from text hashes: the association's bytes are what is tested)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from memgas.pipeline.bank import Bank
from tests.jobs.test_append_index import REPO, _file

CONFIG = ["--set", "retrieval.methods=[session,memgas-cards]", "--set", "reading.enabled=false",
          "--set", "evaluation.ks=[1,3]", "--set", "ray.shard_size=1", "--set", "evaluation.plots=false",
          "--set", "encoder.model=synthetic", "--set", "association.min_prior_nodes=8"]


def _config() -> list[str]:
    return ["--config", str(REPO / "configs" / "demo.yaml"), "--no-ray", *CONFIG]


def _rows(bank: Path, table: str, cols: tuple[str, ...]) -> list[tuple]:
    t = Bank(bank).read(table)
    return sorted(zip(*(t[c].to_pylist() for c in cols)))


def _edges(bank: Path) -> list[tuple]:
    return _rows(bank, "card_graph_edges", ("history_id", "mode", "src", "dst", "similarity"))


def _segments(bank: Path) -> list[tuple]:
    return _rows(bank, "card_graph_edge_segments", ("history_id", "first_session", "end_session"))


def _rankings(run: Path) -> list[dict]:
    rows = [r for r in Bank(run / "results").read("rankings").to_pylist() if r["method"] == "memgas-cards"]
    return sorted(rows, key=lambda r: (r["query_id"], r["rank"]))


def test_an_append_associates_only_new_rows_and_equals_a_fresh_build(tmp_path: Path, cli: Callable) -> None:
    a = _file(tmp_path / "a.jsonl", {0: range(0, 6), 1: range(0, 4)}, {0: [2, 5], 1: [3]})
    b = _file(tmp_path / "b.jsonl", {0: range(6, 9), 1: range(4, 6), 2: range(0, 5)}, {0: [7], 2: [1, 4]})
    grown, fresh = tmp_path / "grown", tmp_path / "fresh"
    cli("ingest", str(a), "--format", "jsonl", "--out", str(grown))
    cli("index", str(grown), *_config())
    before, seg_before = _edges(grown), _segments(grown)
    assert seg_before == [("h0", 0, 6), ("h1", 0, 4)]
    cli("ingest", str(b), "--format", "jsonl", "--append", "--out", str(grown))
    cli("index", str(grown), *_config())
    # only the new sessions' rows were computed: the old segments are still there, new ones start where they end
    assert _segments(grown) == [("h0", 0, 6), ("h0", 6, 9), ("h1", 0, 4), ("h1", 4, 6), ("h2", 0, 5)]
    assert set(before) <= set(_edges(grown))
    cli("ingest", str(a), "--format", "jsonl", "--out", str(fresh))
    cli("ingest", str(b), "--format", "jsonl", "--append", "--out", str(fresh))
    cli("index", str(fresh), *_config())
    assert _segments(fresh) == [("h0", 0, 9), ("h1", 0, 6), ("h2", 0, 5)]
    after = _edges(grown)
    assert after == _edges(fresh)
    assert len(after) > len(before) > 0 and {e[0] for e in after} == {"h0", "h1", "h2"}
    cli("answer", str(grown), *_config(), "--out", str(tmp_path / "run_grown"))
    cli("answer", str(fresh), *_config(), "--out", str(tmp_path / "run_fresh"))
    got = _rankings(tmp_path / "run_grown")
    assert got and got == _rankings(tmp_path / "run_fresh")
