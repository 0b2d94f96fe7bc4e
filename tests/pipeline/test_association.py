"""Association graph: incremental == at once, faiss == dense, no edge crosses histories."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from memgas.pipeline.association import associate, associate_many, candidates, concat_edges

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "locomo_minilm_nodes.npz"


@pytest.fixture(scope="module")
def histories() -> list[np.ndarray]:
    f = np.load(FIXTURE, allow_pickle=False)
    nodes, off = f["nodes"].astype(np.float32), f["conv_offsets"]
    return [nodes[off[i] : off[i + 1]] for i in range(len(off) - 1)]


def as_set(e) -> set:
    return set(zip(e.src.tolist(), e.dst.tolist()))


def test_edges_basic(histories: list[np.ndarray]) -> None:
    h = histories[0]
    e = associate(h)
    assert e.src.dtype == np.int64 and e.dst.dtype == np.int64 and e.sim.dtype == np.float32
    assert (e.src > e.dst).all()
    # src is eligible (>= 20 prior nodes) and dst lies in a strictly earlier session
    assert ((e.src // 4) * 4 >= 20).all() and ((e.dst // 4) < (e.src // 4)).all()
    assert len(as_set(e)) == e.src.size  # stored once
    flat = h.reshape(-1, h.shape[-1]).astype(np.float64)
    np.testing.assert_allclose(e.sim, (flat[e.src] * flat[e.dst]).sum(1), rtol=1e-5)


def test_incremental_equals_at_once(histories: list[np.ndarray]) -> None:
    h = histories[1]
    full = associate(h)
    parts = [associate(h[: s + 1], n_sessions_done=s) for s in range(h.shape[0])]
    inc = concat_edges(parts)
    np.testing.assert_array_equal(inc.src, full.src)
    np.testing.assert_array_equal(inc.dst, full.dst)
    np.testing.assert_array_equal(inc.sim, full.sim)
    # also in two chunks
    two = concat_edges([associate(h[:10]), associate(h, n_sessions_done=10)])
    assert as_set(two) == as_set(full)


def test_many_histories_batched_equals_single(histories: list[np.ndarray]) -> None:
    many = associate_many(histories)
    for h, e in zip(histories, many):
        assert as_set(e) == as_set(associate(h))
        assert e.src.max() < h.shape[0] * 4  # node ids local to the history: no edge crosses histories


def test_faiss_equals_dense(histories: list[np.ndarray]) -> None:
    h = np.concatenate(histories[:3])  # ~80 sessions
    c_dense = candidates(h, search="dense")
    from memgas.pipeline import association as A

    # small faiss blocks (7 sessions) so both the index search and the in-block dense part are exercised
    E = A._as_nodes(h)
    cand, valid = A._faiss_candidates(E, c_dense.rows, 30, "cpu", block_sessions=7)
    cand, valid, sc = A._rescore(E, c_dense.rows, cand, valid)
    np.testing.assert_array_equal(cand, c_dense.cand)
    np.testing.assert_array_equal(sc, c_dense.scores)
    assert as_set(associate(h, search="faiss")) == as_set(associate(h, search="dense"))


def test_topk_mode(histories: list[np.ndarray]) -> None:
    h = histories[2]
    e = associate(h, mode="topk", topk_edges=5)
    rows = np.unique(e.src)
    assert (np.bincount(e.src)[rows] == 5).all()
    c = candidates(h)
    assert as_set(e) == {(int(r), int(d)) for r, row in zip(c.rows, c.cand) for d in row[:5]}
    auto = associate(h, mode="topk")  # default k = mean GMM-accepted count
    g = associate(h)
    assert abs(auto.src.size - g.src.size) <= c.rows.size


def test_short_history_has_no_edges() -> None:
    e = associate(np.random.default_rng(0).normal(size=(5, 4, 8)))
    assert e.src.size == 0


@pytest.mark.parametrize("block_sessions,col_chunk", [(64, 1 << 16), (7, 1 << 16), (5, 37), (1, 4)])
def test_causal_topk_equals_dense_oracle(histories: list[np.ndarray], block_sessions: int, col_chunk: int) -> None:
    """Blocked causal top-k (row blocks against their visible prefix, column chunks merged) == the full
    masked matrix + one top-k, candidate for candidate (same ids, same order, ties by lower id)."""
    from memgas.pipeline import association as A

    h = np.concatenate(histories[:3])  # ~80 sessions
    E = A._as_nodes(h)
    rows = np.arange(20, E.shape[0], dtype=np.int64)
    ref_c, ref_v = A._dense_candidates(E, rows, 30, "cpu")
    got_c, got_v = A._causal_candidates(E, rows, 30, "cpu", block_sessions=block_sessions, col_chunk=col_chunk)
    np.testing.assert_array_equal(got_v, ref_v)
    np.testing.assert_array_equal(got_c, ref_c)
    # incremental rows (a later start) too
    ref_c, ref_v = A._dense_candidates(E, rows[137:], 30, "cpu")
    got_c, got_v = A._causal_candidates(E, rows[137:], 30, "cpu", block_sessions=block_sessions, col_chunk=col_chunk)
    np.testing.assert_array_equal(got_c, ref_c)


def test_causal_topk_ties_and_short_prefix() -> None:
    """Exact ties everywhere (quantised vectors) and prefixes shorter than k: still identical to dense."""
    from memgas.pipeline import association as A

    rng = np.random.default_rng(3)
    E = np.round(rng.normal(size=(4 * 40, 8)), 0).astype(np.float32)  # many equal dot products
    rows = np.arange(20, E.shape[0], dtype=np.int64)
    ref = A._dense_candidates(E, rows, 30, "cpu")
    for bs, cc in [(3, 16), (64, 1 << 16), (1, 7)]:
        got = A._causal_candidates(E, rows, 30, "cpu", block_sessions=bs, col_chunk=cc)
        np.testing.assert_array_equal(got[0], ref[0])
        np.testing.assert_array_equal(got[1], ref[1])


def test_default_search_is_causal_and_matches_dense(histories: list[np.ndarray]) -> None:
    h = np.concatenate(histories[:3])
    assert as_set(associate(h)) == as_set(associate(h, search="dense")) == as_set(associate(h, search="causal"))
    with pytest.raises(ValueError):
        associate(h, search="nope")


# -- huge histories: row blocks, approximate search, block reads ------------------------------------------
def _edges_bytes(e) -> tuple[bytes, bytes, bytes]:
    return e.src.tobytes(), e.dst.tobytes(), e.sim.tobytes()


def test_row_blocks_equal_one_task_exactly(tmp_path: Path) -> None:
    """Random row blocks [a, b) (any boundaries, prefix-only inputs, vectors read from a file) give the
    candidates, scores and edges of one causal task over the whole history, byte for byte."""
    from memgas.pipeline import association as A
    from memgas.pipeline.synth_vectors import clustered_nodes

    S = 700
    E = clustered_nodes(0, S, dim=64, n_topics=40, seed=5)
    ref_c = A.candidates(E, search="causal")
    ref_e = associate(E, search="causal")
    path = tmp_path / "nodes.npy"
    np.save(path, E)
    nf = A.NodeFile(path)
    rng = np.random.default_rng(11)
    for trial in range(3):
        cuts = np.unique(np.concatenate([[0, E.shape[0]], rng.integers(1, E.shape[0], 6 + 3 * trial)]))
        parts_c, parts_e = [], []
        for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            src = E[:b] if trial == 0 else nf  # only the prefix the rows may see (plus the rows), or a file
            parts_c.append(A.causal_rows(src, a, b))
            parts_e.append(A.associate_rows(src, a, b))
        np.testing.assert_array_equal(np.concatenate([c.rows for c in parts_c]), ref_c.rows)
        for f in ("cand", "valid", "scores"):
            got = np.concatenate([getattr(c, f) for c in parts_c])
            assert got.tobytes() == getattr(ref_c, f).tobytes(), (trial, f)
        assert _edges_bytes(concat_edges(parts_e)) == _edges_bytes(ref_e)
    # the split helper: equal-work blocks on tile edges, covering the eligible rows once
    blocks = A.split_rows(E.shape[0], 4, start=20)
    assert blocks[0][0] == 20 and blocks[-1][1] == E.shape[0]
    assert all(b0[1] == b1[0] for b0, b1 in zip(blocks, blocks[1:]))
    assert _edges_bytes(concat_edges([A.associate_rows(nf, a, b) for a, b in blocks])) == _edges_bytes(ref_e)


def test_appended_rows_equal_fresh_build() -> None:
    """Rows of appended sessions, computed alone against the longer history, equal a fresh build's rows."""
    from memgas.pipeline import association as A
    from memgas.pipeline.synth_vectors import clustered_nodes

    E = clustered_nodes(0, 300, dim=48, n_topics=30, seed=2)
    old = A.associate_rows(E[: 4 * 213], 0, 4 * 213)
    new = A.associate_rows(E, 4 * 213, E.shape[0])
    assert _edges_bytes(concat_edges([old, new])) == _edges_bytes(associate(E, search="causal"))


def test_hnsw_recall_and_threshold() -> None:
    """Approximate causal search: candidate recall@30 >= 0.95 against exact search on a seeded clustered
    set, for every store; candidates only from strictly earlier sessions; exact rescored similarities;
    below ``approx_min_nodes`` the search stays exact (identical edges)."""
    from memgas.pipeline import association as A
    from memgas.pipeline.synth_vectors import clustered_nodes

    E = clustered_nodes(0, 600, dim=96, n_topics=40, seed=7)
    ref = A.candidates(E, search="causal")
    ref_edges = as_set(associate(E, search="causal"))
    for store in ("flat", "fp16", "sq8"):
        p = A.HNSWParams(store=store, block_sessions=100)
        c = A.candidates(E, search="hnsw", hnsw=p)
        np.testing.assert_array_equal(c.rows, ref.rows)
        hit = [len(set(a[v].tolist()) & set(b[w].tolist())) / w.sum() for a, v, b, w in
               zip(c.cand, c.valid, ref.cand, ref.valid)]
        assert np.mean(hit) >= 0.95, (store, np.mean(hit))
        ok = c.valid
        assert np.all(c.cand[ok] // 4 < np.broadcast_to(c.rows[:, None] // 4, ok.shape)[ok])  # earlier sessions
        # scores are the exact float64 dot products of the float32 vectors
        rr = np.broadcast_to(c.rows[:, None], ok.shape)[ok]
        exact = np.einsum("rd,rd->r", E[rr].astype(np.float64), E[c.cand[ok]].astype(np.float64))
        np.testing.assert_array_equal(c.scores[ok], exact)
        e = as_set(associate(E, search="hnsw", hnsw=p))
        assert len(e & ref_edges) / len(ref_edges) >= 0.95
    # below the threshold: exact, the same edges as today's default
    assert as_set(associate(E, approx_min_nodes=E.shape[0] + 1)) == ref_edges
    assert as_set(associate(E, approx_min_nodes=E.shape[0], hnsw=A.HNSWParams(block_sessions=100))) != set()


def test_hnsw_append_with_saved_index(tmp_path: Path) -> None:
    """An append searches a saved index for the new rows only: the old rows' edges are kept, the new
    rows' candidates come only from earlier sessions, and the index ends up holding every node."""
    from memgas.pipeline import association as A
    from memgas.pipeline.synth_vectors import clustered_nodes

    E = clustered_nodes(0, 500, dim=64, n_topics=40, seed=3)
    p = A.HNSWParams(block_sessions=64, store="sq8")
    e1, idx = A.associate_hnsw(E[: 4 * 400], hnsw=p)
    idx.save(tmp_path / "h.faiss")
    e2, idx2 = A.associate_hnsw(E, A.CausalHNSW.load(tmp_path / "h.faiss", p), n_sessions_done=400)
    assert idx2.ntotal == E.shape[0]
    assert e2.src.min() >= 4 * 400 and np.all(e2.dst // 4 < e2.src // 4)
    exact_new = associate(E, n_sessions_done=400, search="causal")
    assert len(as_set(e2) & as_set(exact_new)) / len(as_set(exact_new)) >= 0.9
    with pytest.raises(ValueError):
        A.associate_hnsw(E, A.CausalHNSW.load(tmp_path / "h.faiss", p), n_sessions_done=300)


def _ivf_recall(c, ref) -> float:
    return float(np.mean([len(set(a[v].tolist()) & set(b[w].tolist())) / w.sum()
                          for a, v, b, w in zip(c.cand, c.valid, ref.cand, ref.valid)]))


def test_ivf_recall_causality_and_blocks() -> None:
    """IVF causal search: candidate recall@30 >= 0.95 against exact search on a seeded clustered set (IVF
    rows only: ``exact_nodes=0``), for every store; candidates only from strictly earlier sessions; scores
    are the exact float64 products; the candidates do not depend on the session blocks; rows in the
    exact prefix equal the exact search."""
    from memgas.pipeline import association as A
    from memgas.pipeline.synth_vectors import clustered_nodes

    E = clustered_nodes(0, 1000, dim=96, n_topics=20, seed=7)
    ref = A.candidates(E, search="causal")
    for store in ("flat", "fp16", "sq8"):
        p = A.IVFParams(store=store, nlist=64, nprobe=12, block_sessions=100, train_nodes=2048, exact_nodes=0)
        c = A.candidates(E, search="ivf", ivf=p)
        np.testing.assert_array_equal(c.rows, ref.rows)
        assert _ivf_recall(c, ref) >= 0.95, (store, _ivf_recall(c, ref))
        ok = c.valid
        assert np.all(c.cand[ok] // 4 < np.broadcast_to(c.rows[:, None] // 4, ok.shape)[ok])  # earlier sessions
        rr = np.broadcast_to(c.rows[:, None], ok.shape)[ok]
        exact = np.einsum("rd,rd->r", E[rr].astype(np.float64), E[c.cand[ok]].astype(np.float64))
        np.testing.assert_array_equal(c.scores[ok], exact)
    # the blocks' own scores and order are those of the shared exact rescoring (p: the sq8 store)
    blocks = list(A.CausalIVF(96, p).blocks(E, ref.rows, 30))
    for f in ("cand", "valid", "scores"):
        np.testing.assert_array_equal(np.concatenate([getattr(b, f) for _, b in blocks]), getattr(c, f))
    # another block grid: the same candidates, byte for byte
    c2 = A.candidates(E, search="ivf", ivf=A.IVFParams(**{**p.__dict__, "block_sessions": 37}))
    assert c2.cand.tobytes() == c.cand.tobytes() and c2.scores.tobytes() == c.scores.tobytes()
    # rows in the exact prefix: the exact search's candidates
    px = A.IVFParams(nlist=64, nprobe=2, block_sessions=100, train_nodes=2048, exact_nodes=1600)
    cx = A.candidates(E, search="ivf", ivf=px)
    head = cx.rows < 1600
    np.testing.assert_array_equal(cx.cand[head], ref.cand[head])
    with pytest.raises(ValueError):
        A.candidates(E, search="ivf", n_sessions_done=500)


def test_ivf_append_with_saved_index(tmp_path: Path) -> None:
    """An append that searches the saved IVF index (centroids trained on the same prefix) gives the edges
    and candidates of a fresh build over the longer history, byte for byte; a wrong ``n_sessions_done``
    is refused."""
    from memgas.pipeline import association as A
    from memgas.pipeline.synth_vectors import clustered_nodes

    E = clustered_nodes(0, 700, dim=64, n_topics=30, seed=3)
    p = A.IVFParams(nlist=32, nprobe=4, block_sessions=64, train_nodes=1024, exact_nodes=256)
    e1, idx = A.associate_ivf(E[: 4 * 450], ivf=p)
    idx.save(tmp_path / "i.faiss")
    e2, idx2 = A.associate_ivf(E, A.CausalIVF.load(tmp_path / "i.faiss", p), n_sessions_done=450)
    assert idx2.ntotal == E.shape[0]
    fresh, _ = A.associate_ivf(E, ivf=p)
    new = fresh.src >= 4 * 450
    for f in ("src", "dst", "sim"):
        assert getattr(e2, f).tobytes() == getattr(fresh, f)[new].tobytes()
        assert getattr(e1, f).tobytes() == getattr(fresh, f)[~new].tobytes()
    rows = np.arange(4 * 450, E.shape[0])
    cf = A.CausalIVF(64, p).candidates(E, np.arange(20, E.shape[0]), 30)
    ca = A.CausalIVF.load(tmp_path / "i.faiss", p).candidates(E, rows, 30)
    assert ca[0].tobytes() == cf[0][-rows.size :].tobytes()
    assert np.all(e2.dst // 4 < e2.src // 4)
    with pytest.raises(ValueError):
        A.associate_ivf(E, A.CausalIVF.load(tmp_path / "i.faiss", p), n_sessions_done=400)
