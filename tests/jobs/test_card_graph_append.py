"""memgas-cards' edges after an append: segmented like MemGAS's, so ``memgas index`` after ``memgas ingest
--append`` associates only the new sessions' rows, and the edges (and memgas-cards' rankings) equal those of one
build over everything, byte for byte. Through the CLI in-process, no Ray, the LLM-free generator and card
extractor and the synthetic encoder (vectors from text hashes: the association's bytes are what is tested)."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory, cli: Callable) -> dict[str, Path]:
    """Files A and B (B: more sessions of A's histories and a new one) and a bank of A + B indexed once."""
    d = tmp_path_factory.mktemp("cards_append")
    a = _file(d / "a.jsonl", {0: range(0, 6), 1: range(0, 4)}, {0: [2, 5], 1: [3]})
    b = _file(d / "b.jsonl", {0: range(6, 9), 1: range(4, 6), 2: range(0, 5)}, {0: [7], 2: [1, 4]})
    cli("ingest", str(a), "--format", "jsonl", "--out", str(d / "fresh"))
    cli("ingest", str(b), "--format", "jsonl", "--append", "--out", str(d / "fresh"))
    cli("index", str(d / "fresh"), *_config())
    return {"a": a, "b": b, "bank": d / "fresh"}


def test_an_append_associates_only_new_rows_and_equals_a_fresh_build(tmp_path: Path, cli: Callable,
                                                                      fresh: dict[str, Path]) -> None:
    a, b, grown = fresh["a"], fresh["b"], tmp_path / "grown"
    cli("ingest", str(a), "--format", "jsonl", "--out", str(grown))
    cli("index", str(grown), *_config())
    before, seg_before = _edges(grown), _segments(grown)
    assert seg_before == [("h0", 0, 6), ("h1", 0, 4)]
    cli("ingest", str(b), "--format", "jsonl", "--append", "--out", str(grown))
    cli("index", str(grown), *_config())
    # only the new sessions' rows were computed: the old segments are still there, new ones start where they end
    assert _segments(grown) == [("h0", 0, 6), ("h0", 6, 9), ("h1", 0, 4), ("h1", 4, 6), ("h2", 0, 5)]
    assert set(before) <= set(_edges(grown))
    assert _segments(fresh["bank"]) == [("h0", 0, 9), ("h1", 0, 6), ("h2", 0, 5)]
    after = _edges(grown)
    assert after == _edges(fresh["bank"])
    assert len(after) > len(before) > 0 and {e[0] for e in after} == {"h0", "h1", "h2"}
    cli("answer", str(grown), *_config(), "--out", str(tmp_path / "run_grown"))
    cli("answer", str(fresh["bank"]), *_config(), "--out", str(tmp_path / "run_fresh"))
    got = _rankings(tmp_path / "run_grown")
    assert got and got == _rankings(tmp_path / "run_fresh")


def test_long_prefixes_go_in_node_blocks_and_give_the_same_edges(tmp_path: Path, cli: Callable,
                                                                  fresh: dict[str, Path],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With blocks of 32 rows (8 sessions of MemGAS nodes), h0's prefix (9 sessions) is built a block at a time,
    h2's (5 sessions, more than 32 nodes with its cards) is cut into blocks from the graph built whole, and
    the tasks read both as NodeBlocks: the edges are those of the whole matrices."""
    from memgas.jobs.history_index import card_blocks
    from memgas.pipeline.association import blocks
    from memgas.pipeline.card_graph import CardGraph

    monkeypatch.setattr(blocks, "BLOCK_ROWS", 32)
    seen: dict[str, list[int]] = {"built": [], "cut": [], "read": []}
    build, cut, read = card_blocks.CardGraphBlocks.graph, card_blocks.matrix_blocks, CardGraph.from_arrays.__func__

    def spy_build(self, end):  # noqa: ANN001, ANN202
        seen["built"].append(end)
        return build(self, end)

    def spy_cut(ctx, m, block_rows):  # noqa: ANN001, ANN202
        seen["cut"].append(m.shape[0])
        return cut(ctx, m, block_rows)

    def spy_read(cls, a):  # noqa: ANN001, ANN202
        seen["read"].append(isinstance(a["nodes"], blocks.NodeBlocks))
        return read(cls, a)

    monkeypatch.setattr(card_blocks.CardGraphBlocks, "graph", spy_build)
    monkeypatch.setattr(card_blocks, "matrix_blocks", spy_cut)
    monkeypatch.setattr("memgas.jobs.stages.card_graph_associate.matrix_blocks", spy_cut)
    monkeypatch.setattr(CardGraph, "from_arrays", classmethod(spy_read))
    bank = tmp_path / "bank"
    cli("ingest", str(fresh["a"]), "--format", "jsonl", "--out", str(bank))
    cli("ingest", str(fresh["b"]), "--format", "jsonl", "--append", "--out", str(bank))
    cli("index", str(bank), *_config())
    assert seen["built"] == [9] and len(seen["cut"]) >= 1 and all(n > 32 for n in seen["cut"]), seen
    assert sum(seen["read"]) == 1 + len(seen["cut"]), seen
    assert _segments(bank) == _segments(fresh["bank"])
    assert _edges(bank) == _edges(fresh["bank"])


def test_under_ivf_past_the_exact_prefix_an_append_equals_a_fresh_build(tmp_path: Path, cli: Callable,
                                                                        fresh: dict[str, Path],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """association.search=ivf with an exact prefix of 40 nodes and a grid of 4 sessions: the rows past it are
    searched by the IVF walk (pipeline/card_graph_ivf.py), their recall sample is stored per segment, and an
    append's edges equal a fresh build's."""
    from memgas.pipeline.association import ivf_search

    monkeypatch.setattr(ivf_search, "STAGE_BLOCK_SESSIONS", 4)
    ivf = [*_config(), "--set", "association.search=ivf", "--set", "association.ivf_exact_nodes=40",
           "--set", "association.ivf_nlist=1", "--set", "association.ivf_nprobe=1"]
    grown, one = tmp_path / "grown", tmp_path / "one"
    cli("ingest", str(fresh["a"]), "--format", "jsonl", "--out", str(grown))
    cli("index", str(grown), *ivf)
    cli("ingest", str(fresh["b"]), "--format", "jsonl", "--append", "--out", str(grown))
    cli("index", str(grown), *ivf)
    cli("ingest", str(fresh["a"]), "--format", "jsonl", "--out", str(one))
    cli("ingest", str(fresh["b"]), "--format", "jsonl", "--append", "--out", str(one))
    cli("index", str(one), *ivf)
    assert _segments(grown) == [("h0", 0, 6), ("h0", 6, 9), ("h1", 0, 4), ("h1", 4, 6), ("h2", 0, 5)]
    assert _edges(grown) == _edges(one)
    rec = Bank(one).read("card_graph_ivf_recall").to_pylist()
    assert rec and all(r["row"] >= 40 and 0 <= r["hits"] <= r["total"] for r in rec)
    assert {r["history_id"] for r in rec} >= {"h0"}
