"""PreparedGraph (pipeline/prepared.py): one history prepared once, ranked in batches or one query at a time.

- Its float64 similarities over node-row blocks equal the whole-matrix product bit for bit, and so do the
  single-granularity baselines (the machine's BLAS: see the module docstring), from arrays or NodeBlocks.
- On real MiniLM node vectors (LoCoMo fixture) every MemGAS method, exact and push PPR, equals the
  whole-matrix formulation the rank stage used before (CSR and float64 matrix rebuilt per call), byte for byte.
- One question at a time gives the batch's top-10 (push and exact PPR both run each question on its own, so
  its scores differ from the batch's only through the similarity product's kernel: gemv for one, gemm for many).
"""
from __future__ import annotations

import numpy as np
import pytest

from memgas.kernels.backend import one_blas_thread
from memgas.kernels.ppr import build_csr, personalized_pagerank
from memgas.kernels.ppr_push import personalized_pagerank_push
from memgas.kernels.router import entropy_router
from memgas.kernels.segment import segment_sum_contiguous
from memgas.kernels.topk import stable_argsort_desc
from memgas.pipeline.association.blocks import NodeBlocks
from memgas.pipeline.association.nodes import NodeFile
from memgas.pipeline.methods import get_method
from memgas.pipeline import prepared
from memgas.pipeline.prepared import SIM_BLOCK_ROWS, PreparedGraph, row_spans, seed_reset
from tests.fixtures.locomo_minilm import locomo_minilm_histories

GRAPH_METHODS = ["memgas", "memgas-no-gmm", "memgas-no-ppr", "memgas-no-router", "memgas-no-association"]
BASELINES = ["session", "turn", "summary", "keyword", "hybrid"]
SETTINGS = {"num_seeds": 15, "damping": 0.1, "temp": 0.2, "router": "reference"}


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def test_row_spans() -> None:
    B = SIM_BLOCK_ROWS
    assert row_spans(4) == [(0, 4)]
    assert row_spans(2 * B - 4) == [(0, 2 * B - 4)]  # under two blocks: the whole matrix, one call
    assert row_spans(2 * B) == [(0, B), (B, 2 * B)]
    assert row_spans(3 * B + 100) == [(0, B), (B, 2 * B), (2 * B, 3 * B + 100)]  # the last takes the rest


@pytest.mark.parametrize("n_queries", [1, 2, 5, 33])
def test_blocked_products_equal_the_whole_matrix(n_queries: int, tmp_path) -> None:
    """Three blocks and a remainder of real-size rows (d = 384): similarities (float64, gemv for one query,
    gemm otherwise) and baselines (float32, strided granularity rows; the contiguous hybrid matrix) have the
    bits of one product over the whole matrix, from an array, from NodeBlocks of another block size (arrays,
    and spill files read through their memory maps), with one scan thread or three."""
    rng = np.random.default_rng(n_queries)
    n, d = 3 * SIM_BLOCK_ROWS + 4 * 97, 384
    E = rng.standard_normal((n, d)).astype(np.float32)
    H = rng.standard_normal((n // 4, d)).astype(np.float32)
    q = rng.standard_normal((n_queries, d)).astype(np.float32)
    step = 4 * 3000  # not a multiple of GEMV_ROWS: a gemv block then spans two node blocks
    blocks = NodeBlocks([E[i : i + step] for i in range(0, n, step)], step, n, d)
    files = []
    for i in range(0, n, step):
        np.save(tmp_path / f"{i}.npy", E[i : i + step])
        files.append(NodeFile(tmp_path / f"{i}.npy"))
    spilled = NodeBlocks(files, step, n, d)
    with one_blas_thread():
        whole = q.astype(np.float64) @ E.astype(np.float64).T
        for nodes, threads in ((E, 1), (blocks, 1), (spilled, 1), (E, 3), (spilled, 3)):
            g = PreparedGraph(nodes, hybrid=H, scan_threads=threads)
            assert _bits(g.similarities(q)) == _bits(whole), (type(nodes).__name__, threads)
            for i, gran in enumerate(BASELINES[:4]):
                assert _bits(g.baseline_scores(q, gran)) == _bits(q @ E[i::4].T), gran
            assert _bits(g.baseline_scores(q, "hybrid")) == _bits(q @ H.T)


def _reference(nodes: np.ndarray, q: np.ndarray, edges: dict, method: str, ppr: str, eps: float,
               hybrid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rank stage's formulation before PreparedGraph (score_with_edges at 1531295): the whole node matrix
    in float64, the CSR built per call."""
    m = get_method(method)
    S = nodes.shape[0] // 4
    if not m.is_graph:
        H = hybrid if m.granularity == "hybrid" else nodes[BASELINES.index(m.granularity) :: 4]
        scores = q @ H.T
        return stable_argsort_desc(scores).astype(np.int64), scores.astype(np.float64)
    sims = q.astype(np.float64) @ nodes.astype(np.float64).T
    if not m.router:
        w = np.full((q.shape[0], 4), 0.25)
    else:
        w, _ = entropy_router([sims[:, g::4] for g in range(4)], temp=SETTINGS["temp"], rule=SETTINGS["router"])
    node_scores = sims * np.tile(w, (1, S))
    if not m.ppr:
        scores = segment_sum_contiguous(node_scores, 4)
    else:
        reset = seed_reset(node_scores, SETTINGS["num_seeds"])
        src, dst = edges[m.edges] if m.edges is not None else (np.zeros(0, np.int64), np.zeros(0, np.int64))
        adj = build_csr(src, dst, nodes.shape[0])
        if ppr == "push":
            pr = personalized_pagerank_push(adj, reset, SETTINGS["damping"], epsilon=eps)
        else:
            pr = personalized_pagerank(adj, reset, SETTINGS["damping"])
        scores = segment_sum_contiguous(pr, 4)
    return stable_argsort_desc(scores).astype(np.int64), scores.astype(np.float64)


@pytest.fixture(scope="module")
def histories() -> list[tuple[np.ndarray, np.ndarray, dict, np.ndarray]]:
    """Three LoCoMo histories: node matrix, questions, gmm and top-k edges (the real association), and a
    hybrid matrix (the session rows plus the summary rows: any [S, d] will do)."""
    with one_blas_thread():
        return [(nodes, qs, edges, np.ascontiguousarray(nodes[0::4] + nodes[2::4]))
                for nodes, qs, edges in locomo_minilm_histories(3)]


@pytest.mark.parametrize("ppr", ["exact", "push"])
def test_prepared_equals_the_whole_matrix_formulation_on_minilm(histories: list, ppr: str) -> None:
    eps = 1e-4
    with one_blas_thread():
        for nodes, qs, edges, hybrid in histories:
            g = PreparedGraph(nodes, edges, hybrid=hybrid)
            got = g.rank(qs, GRAPH_METHODS + BASELINES, ppr=ppr, ppr_epsilon=eps, **SETTINGS)
            for m in GRAPH_METHODS + BASELINES:
                want = _reference(nodes, qs, edges, m, ppr, eps, hybrid)
                assert _bits(got[m][0]) == _bits(want[0]) and _bits(got[m][1]) == _bits(want[1]), m
            assert set(g._csr) == {"gmm", "topk", None}  # each graph built once, for all the methods
            again = g.rank(qs, ["memgas"], ppr=ppr, ppr_epsilon=eps, **SETTINGS)["memgas"]
            assert _bits(again[1]) == _bits(got["memgas"][1])  # the kept graph ranks the same


@pytest.mark.parametrize("ppr", ["exact", "push"])
def test_one_question_at_a_time_gives_the_batch_top10(histories: list, ppr: str) -> None:
    with one_blas_thread():
        for nodes, qs, edges, _ in histories:
            g = PreparedGraph(nodes, edges).prepare(["memgas"], ppr=ppr)
            batch = g.rank(qs, ["memgas"], ppr=ppr, **SETTINGS)["memgas"]
            for i in range(qs.shape[0]):
                order, scores = g.rank(qs[i : i + 1], ["memgas"], ppr=ppr, **SETTINGS)["memgas"]
                assert (order[0, :10] == batch[0][i, :10]).all(), i
                np.testing.assert_allclose(scores[0], batch[1][i], rtol=0, atol=1e-9)


def test_query_chunks() -> None:
    """Chunks on the host, over a history of at least SIM_BLOCK_ROWS rows; never a lone question."""
    C = prepared.RANK_QUERY_CHUNK
    long = PreparedGraph(np.zeros((SIM_BLOCK_ROWS, 4), np.float32))
    short = PreparedGraph(np.zeros((SIM_BLOCK_ROWS - 4, 4), np.float32))
    assert long.query_chunks(2 * C + 3) == [(0, C), (C, 2 * C), (2 * C, 2 * C + 3)]
    assert long.query_chunks(2 * C + 1) == [(0, C), (C, 2 * C + 1)]  # the lone one joins
    assert long.query_chunks(C) == [(0, C)]
    assert short.query_chunks(2 * C + 3) == [(0, 2 * C + 3)]


def test_query_chunks_shrink_on_a_long_history(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk's [Q, 4S] float64 arrays stay within RANK_CHUNK_ARRAY_BYTES, with never fewer than 2 questions."""
    g = PreparedGraph(np.zeros((SIM_BLOCK_ROWS, 4), np.float32))
    monkeypatch.setattr(prepared, "RANK_CHUNK_ARRAY_BYTES", 8 * SIM_BLOCK_ROWS * 5)  # room for 5 questions
    assert g.query_chunks(12) == [(0, 5), (5, 10), (10, 12)]
    assert g.query_chunks(11) == [(0, 5), (5, 11)]  # the lone one joins
    monkeypatch.setattr(prepared, "RANK_CHUNK_ARRAY_BYTES", 8 * SIM_BLOCK_ROWS // 2)  # not even one: 2 anyway
    assert g.query_chunks(5) == [(0, 2), (2, 5)]
    monkeypatch.undo()
    n_nodes = 4 * 1_000_000  # 10^6 sessions: 256 MiB hold 8 questions
    assert prepared.RANK_CHUNK_ARRAY_BYTES // (8 * n_nodes) == 8


@pytest.mark.parametrize("n_queries", [35, 33])
def test_rank_top_in_chunks_equals_the_whole_batch(n_queries: int) -> None:
    """Every method under push and under exact PPR, ranked in query chunks, has the bits of the whole batch's
    ranking in its top rows; with three blocks of real-size rows and a lone last question (33 = 16 + 17)."""
    rng = np.random.default_rng(n_queries)
    n, d = 2 * SIM_BLOCK_ROWS + 4 * 37, 384
    E = rng.standard_normal((n, d)).astype(np.float32)
    E /= np.linalg.norm(E, axis=1, keepdims=True)
    q = E[rng.integers(0, n, n_queries)] + 0.1 * rng.standard_normal((n_queries, d)).astype(np.float32)
    src = rng.integers(1, n, 20 * n)
    edges = {mode: (src, rng.integers(0, src)) for mode in ("gmm", "topk")}  # each edge to an earlier node
    hybrid = np.ascontiguousarray(E[0::4] + E[2::4])
    with one_blas_thread():
        g = PreparedGraph(E, edges, hybrid=hybrid)
        assert len(g.query_chunks(n_queries)) == 2 + (n_queries == 35)
        for ppr, methods in (("push", GRAPH_METHODS + BASELINES), ("exact", GRAPH_METHODS + BASELINES)):
            whole = g.rank(q, methods, ppr=ppr, ppr_epsilon=1e-4, **SETTINGS)
            tops = g.rank_top(q, methods, 50, ppr=ppr, ppr_epsilon=1e-4, **SETTINGS)
            for m in methods:
                order, scores = whole[m]
                assert _bits(tops[m][0]) == _bits(order[:, :50]), (ppr, m)
                assert _bits(tops[m][1]) == _bits(np.take_along_axis(scores, order[:, :50], axis=1)), (ppr, m)


@pytest.mark.parametrize("ppr", ["push", "exact"])
def test_rank_with_top_equals_the_stable_sorts_first_columns_ties_included(ppr: str) -> None:
    """``rank(top=k)`` (a partial selection, no sort of every session) gives the first ``k`` columns of the
    full stable sort's order, bit for bit, at boundaries that cut through runs of tied sessions: every session
    appears five times (the same node rows), and the sessions PPR does not reach tie at zero."""
    rng = np.random.default_rng(5)
    base = rng.standard_normal((4 * 8, 16)).astype(np.float32)
    E = np.tile(base, (5, 1))  # 40 sessions, session s equal to session s mod 8
    q = E[rng.integers(0, E.shape[0], 3)] + 0.05 * rng.standard_normal((3, 16)).astype(np.float32)
    src = rng.integers(1, E.shape[0], 60)
    edges = {mode: (src, rng.integers(0, src)) for mode in ("gmm", "topk")}
    methods = GRAPH_METHODS + [m for m in BASELINES if m != "hybrid"]
    g = PreparedGraph(E, edges)
    whole = g.rank(q, methods, ppr=ppr, ppr_epsilon=1e-4, **SETTINGS)
    tied = 0
    for k in (1, 3, 7, 12, 39, 40, 41):
        part = g.rank(q, methods, ppr=ppr, ppr_epsilon=1e-4, top=k, **SETTINGS)
        for m in methods:
            order, scores = whole[m]
            assert _bits(part[m][0]) == _bits(order[:, :k]), (k, m)
            assert _bits(part[m][1]) == _bits(scores), (k, m)
            if k < 40:
                kth = np.take_along_axis(scores, order[:, k - 1 : k], axis=1)
                tied += int((np.take_along_axis(scores, order[:, k:], axis=1) == kth).any(axis=1).sum())
    assert tied > 0  # some boundary cut a run of equal scores
