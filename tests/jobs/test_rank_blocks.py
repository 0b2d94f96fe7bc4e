"""The rank stage reads a long history's node vectors in row blocks (bounded memory).

A seeded bank (``test_node_blocks.seeded_bank``: synthetic node vectors, no encoder) with questions whose
vectors are stored under the encoder key, and a seeded graph per history. With tiny blocks a long history
reaches the task as NodeBlocks (the driver's payload holds no node matrix of it), and its rankings equal, byte
for byte, those of the whole matrix that the stage shipped before; a short history still goes as one matrix.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from memgas.jobs.keys import encoder_key
from memgas.jobs.stage import StageContext
from memgas.jobs.stages import rank
from memgas.jobs.stages.rank import RankStage
from memgas.pipeline.association import blocks
from memgas.pipeline.association.blocks import NodeBlocks
from memgas.pipeline.bank import Bank
from memgas.pipeline.encode import query_hash
from memgas.pipeline.schema import QUERIES, embeddings_schema
from tests.jobs.test_node_blocks import seeded_bank

SESSIONS = {"h": 150, "g": 12}
DIM = 32


@pytest.fixture(scope="module")
def bank(tmp_path_factory: pytest.TempPathFactory) -> tuple[Bank, StageContext]:
    b, ctx = seeded_bank(tmp_path_factory.mktemp("rank_blocks") / "bank", SESSIONS, dim=DIM)
    rng = np.random.default_rng(3)
    qs = [(f"{h}-q{i}", h, f"question {i} about {h}") for h in sorted(SESSIONS) for i in range(5)]
    n = len(qs)
    cols = {"query_id": [q[0] for q in qs], "history_id": [q[1] for q in qs], "question": [q[2] for q in qs],
            "answer": ["a"] * n, "question_type": ["t"] * n, "is_abstention": [False] * n}
    b.write("queries", pa.table({f: cols.get(f, [None] * n) for f in QUERIES.names}, schema=QUERIES))
    vec = rng.standard_normal((n, DIM)).astype(np.float32)
    b.write_part("embeddings", "queries", pa.table({
        "text_hash": [query_hash(q[2]) for q in qs], "encoder": [encoder_key(ctx)] * n,
        "vector": pa.FixedSizeListArray.from_arrays(pa.array(vec.ravel(), pa.float32()), DIM),
        "truncated": [False] * n, "tokens": [1] * n, "tokens_dropped": [0] * n}, schema=embeddings_schema(DIM)),
        dim=DIM)
    return b, ctx


def _edges(bank: Bank, history_ids: list[str], parts: list[str]) -> dict:
    """A seeded graph per history and mode (the stage reads stored edges; none are stored here)."""
    out = {}
    for h in history_ids:
        n = 4 * SESSIONS[h]
        rng = np.random.default_rng([ord(h), 5])
        for mode, m in (("gmm", 3 * n), ("topk", 2 * n)):
            out[(h, mode)] = (rng.integers(0, n, m).astype(np.int64), rng.integers(0, n, m).astype(np.int64))
    return out


def _params(ctx: StageContext, ppr: str) -> dict[str, Any]:
    methods = ["session", "turn", "summary", "keyword", "memgas", "memgas-no-gmm", "memgas-no-ppr",
               "memgas-no-router", "memgas-no-association"]
    return {"retrieval": {**ctx.cfg.retrieval.model_dump(), "methods": methods, "ppr": ppr}, "device": "cpu"}


def _ipc(t: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("ppr", ["exact", "push"])
def test_blocked_rankings_equal_the_whole_matrix_byte_for_byte(bank: tuple[Bank, StageContext], ppr: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _, ctx = bank
    monkeypatch.setattr(rank, "edges_of", _edges)
    monkeypatch.setattr(rank.tables, "current_parts", lambda ctx, name: [])  # no runner here: _edges stands in
    unit = {"histories": ["g", "h"], "inputs": ["x", "y"], "questions": [5, 5]}
    stage = RankStage()
    want_payload = stage.inputs(ctx, unit)  # BLOCK_ROWS (65,536 rows) holds both: matrices, as before
    assert all("matrices" in h for h in want_payload["histories"])
    want = RankStage.run(None, want_payload, _params(ctx, ppr))
    monkeypatch.setattr(blocks, "BLOCK_ROWS", 64)  # 16 sessions: h (150) is long, g (12) is not
    payload = stage.inputs(ctx, unit)
    kinds = {h["history_id"]: type(h.get("nodes", h.get("matrices"))).__name__ for h in payload["histories"]}
    assert kinds == {"g": "dict", "h": "NodeBlocks"}
    nb = payload["histories"][1]["nodes"]
    assert isinstance(nb, NodeBlocks) and nb.shape == (4 * 150, DIM) and len(nb.blocks) == -(-600 // 64)
    assert payload["histories"][1]["session_ids"] == [f"h-{s}" for s in range(150)]
    got = RankStage.run(None, payload, _params(ctx, ppr))
    assert got["rankings"].num_rows > 0
    assert {k: _ipc(t) for k, t in got.items()} == {k: _ipc(t) for k, t in want.items()}
    ctx.scratch.clear()


def test_edges_of_groups_as_pandas_did(tmp_path: Any) -> None:
    """edges_of (dictionary codes and a stable sort, no de-duplication) against pandas' groupby over Bank.read
    (de-duplicated), its old implementation: the same groups, each in the rows' order, over two segment parts,
    three histories and both modes; a history not asked for is left out."""
    from memgas.pipeline.schema import EDGES

    b = Bank.create(tmp_path / "bank")
    rng = np.random.default_rng(7)
    for part, lo in (("p1", 0), ("p2", 50)):  # as the associate stage's segments: disjoint rows (src), no edge twice
        n = 500
        key = rng.choice(3 * 2 * 50 * 99, n, replace=False)  # (history, mode, src - lo, dst), in random order
        h, m, src, dst = np.unravel_index(key, (3, 2, 50, 99))
        b.write_part("edges", part, pa.table({
            "history_id": np.array(["a", "b", "c"])[h].tolist(), "src": (lo + src).astype(np.int32),
            "dst": dst.astype(np.int32), "similarity": rng.random(n).astype(np.float32),
            "mode": np.array(["gmm", "topk"])[m].tolist()}, schema=EDGES))
    got = rank.edges_of(b, ["a", "c"], ["p1", "p2"])
    df = b.read("edges", parts=["p1", "p2"]).to_pandas()
    df = df[df["history_id"].isin(["a", "c"])]
    want = {k: (g["src"].to_numpy(np.int64), g["dst"].to_numpy(np.int64))
            for k, g in df.groupby(["history_id", "mode"], sort=False)}
    assert sorted(got) == sorted(want) == [("a", "gmm"), ("a", "topk"), ("c", "gmm"), ("c", "topk")]
    for k, (src, dst) in want.items():
        assert got[k][0].dtype == np.int64 and got[k][0].tolist() == src.tolist() and got[k][1].tolist() == dst.tolist()
    assert rank.edges_of(b, ["a"], []) == {}


def test_the_latency_probe_reads_a_long_history_in_blocks(bank: tuple[Bank, StageContext],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`memgas answer`'s probe (rank.ranking_latency) prepares a long history from row blocks spilled to
    files, as the rank stage does in-process: the matrix loader is asked for the short history only (it held
    the whole matrix of a 10^6-session history, ~6 GB and its copies), and every question is timed."""
    from memgas.jobs.history_index import node_blocks
    from memgas.jobs.stages import shards

    _, ctx = bank
    monkeypatch.setattr(rank, "edges_of", _edges)
    monkeypatch.setattr(rank.tables, "current_parts", lambda ctx, name: [])
    monkeypatch.setattr(blocks, "BLOCK_ROWS", 64)  # h (150 sessions) is long, g (12) is not
    asked, spilled = [], []
    real_loader, real_blocks = shards.matrix_loader, node_blocks.HistoryBlocks

    def loader(ctx: StageContext, hids: list[str]) -> Any:
        asked.append(list(hids))
        return real_loader(ctx, hids)

    class Blocks(real_blocks):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            spilled.append((a[1], self.use_ray))

    monkeypatch.setattr(shards, "matrix_loader", loader)
    monkeypatch.setattr(node_blocks, "HistoryBlocks", Blocks)
    out = rank.ranking_latency(ctx, n_queries=10)
    assert asked == [["g"]] and spilled == [("h", False)]
    assert out["n"] == 10 and out["p50_ms"] > 0
