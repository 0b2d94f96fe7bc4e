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
    # 'auto' switches to faiss above the node threshold
    assert as_set(associate(h, dense_max_nodes=100)) == as_set(associate(h))


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
