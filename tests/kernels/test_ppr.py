"""Batched PPR vs python-igraph (prpack) and networkx."""
from __future__ import annotations

import igraph as ig
import networkx as nx
import numpy as np
import scipy.sparse as sp
import pytest

from memgas.kernels.ppr import build_csr, personalized_pagerank


def random_graph(rng: np.random.Generator, n: int, e: int, n_isolated: int) -> tuple[np.ndarray, np.ndarray]:
    s = rng.integers(0, n - n_isolated, e)
    t = rng.integers(0, n - n_isolated, e)
    keep = s != t
    return s[keep], t[keep]


def igraph_ppr(n: int, s: np.ndarray, t: np.ndarray, r: np.ndarray, d: float) -> np.ndarray:
    pairs = sorted({(min(a, b), max(a, b)) for a, b in zip(s.tolist(), t.tolist())})
    g = ig.Graph(n=n, edges=pairs, directed=False)
    return np.array(g.personalized_pagerank(directed=False, damping=d, reset=r.tolist(), implementation="prpack"))


@pytest.mark.parametrize("damping", [0.1, 0.5, 0.85])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_matches_igraph(damping: float, index_dtype: type) -> None:
    rng = np.random.default_rng(int(damping * 100))
    n = 60
    s, t = random_graph(rng, n, 70, n_isolated=8)
    s = np.concatenate([s, t[:5]])  # duplicates in reversed direction
    t = np.concatenate([t, s[:5]])
    A = build_csr(s, t, n, index_dtype=index_dtype)
    assert A.indices.dtype == index_dtype
    R = rng.random((7, n)) * (rng.random((7, n)) < 0.3)
    R[0, -3:] = 1.0  # isolated seeds
    R[1] = 0.0  # all-zero row
    X = personalized_pagerank(A, R, damping)
    assert np.all(X[1] == 0)
    for q in [0, *range(2, 7)]:
        np.testing.assert_allclose(X[q], igraph_ppr(n, s, t, R[q], damping), atol=1e-6)
        assert abs(X[q].sum() - 1) < 1e-9


def test_matches_networkx() -> None:
    rng = np.random.default_rng(7)
    n = 40
    s, t = random_graph(rng, n, 50, n_isolated=5)
    G = nx.Graph()
    G.add_nodes_from(range(n))
    G.add_edges_from(zip(s.tolist(), t.tolist()))
    R = rng.random((3, n))
    X = personalized_pagerank(build_csr(s, t, n), R, 0.85)
    for q in range(3):
        # networkx alpha = probability of following an edge (same as igraph damping); dangling -> personalization
        ref = nx.pagerank(G, alpha=0.85, personalization=dict(enumerate(R[q])), tol=1e-13, max_iter=10_000)
        np.testing.assert_allclose(X[q], [ref[i] for i in range(n)], atol=1e-6)


def test_empty_graph_returns_normalised_reset() -> None:
    R = np.array([[1.0, 2.0, 0.0, 0.0], [0, 0, 0, 0]])
    X = personalized_pagerank(build_csr([], [], 4), R, 0.1)
    np.testing.assert_allclose(X[0], igraph_ppr(4, np.array([], int), np.array([], int), R[0], 0.1), atol=1e-12)
    np.testing.assert_allclose(X[0], [1 / 3, 2 / 3, 0, 0])
    assert not X[1].any()


def test_build_csr_dedup_and_selfloops() -> None:
    A = build_csr([0, 1, 1, 2], [1, 0, 1, 0], 3)
    assert A.nnz == 4 and A[0, 1] == 1 and A[1, 1] == 0 and (A != A.T).nnz == 0
    with pytest.raises(ValueError):
        build_csr([0], [3], 3)


def scipy_csr(src: np.ndarray, dst: np.ndarray, n: int, index_dtype: type = np.int32) -> sp.csr_matrix:
    """The old construction, the oracle: scipy's COO -> CSR and sum_duplicates over both directions (also the
    baseline of the CSR construction it replaced)."""
    keep = src != dst
    a, b = np.minimum(src[keep], dst[keep]), np.maximum(src[keep], dst[keep])
    key = np.unique(a * n + b)
    a, b = key // n, key % n
    m = sp.csr_matrix((np.ones(2 * a.size), (np.concatenate([a, b]), np.concatenate([b, a]))), shape=(n, n))
    m.sum_duplicates()
    m.indices, m.indptr = m.indices.astype(index_dtype, copy=False), m.indptr.astype(index_dtype, copy=False)
    return m


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_build_csr_equals_scipys_construction_array_for_array(index_dtype: type) -> None:
    """The direct construction gives scipy's arrays exactly (data, indices, indptr and their dtypes): repeated
    pairs in both directions, self-loops, isolated and last nodes, an empty graph."""
    rng = np.random.default_rng(1)
    for n, m in ((1, 0), (5, 0), (50, 400), (1000, 20_000), (3000, 500)):
        s, t = rng.integers(0, n, m), rng.integers(0, n, m)
        s, t = np.r_[s, t[: m // 3]], np.r_[t, s[: m // 3]]  # some pairs again, reversed
        got, want = build_csr(s, t, n, index_dtype=index_dtype), scipy_csr(s, t, n, index_dtype)
        for attr in ("data", "indices", "indptr"):
            g, w = getattr(got, attr), getattr(want, attr)
            assert g.dtype == w.dtype and np.array_equal(g, w), (n, m, attr)
        assert got.has_sorted_indices and got.shape == (n, n)


@pytest.mark.parametrize("check_every", [2, 7, 16])
def test_blocked_convergence_check_is_exact(monkeypatch: pytest.MonkeyPatch, check_every: int) -> None:
    """Reading the convergence test every k iterations (the CUDA path) returns exactly the per-iteration result:
    X is frozen from the first converged iteration. Dangling nodes, an all-zero row and non-convergence too."""
    from memgas.kernels import ppr

    rng = np.random.default_rng(check_every)
    n = 120
    s, t = random_graph(rng, n, 200, n_isolated=10)
    A = build_csr(s, t, n)
    R = rng.random((9, n)) * (rng.random((9, n)) < 0.4)
    R[0] = 0.0
    R[1, -2:] = 1.0
    cases = [dict(damping=d) for d in (0.1, 0.85)] + [dict(damping=0.85, max_iter=5)]
    ref = [personalized_pagerank(A, R, **kw) for kw in cases]
    monkeypatch.setitem(ppr.CHECK_EVERY, "cpu", check_every)
    for kw, r in zip(cases, ref):
        np.testing.assert_array_equal(personalized_pagerank(A, R, **kw), r)


@pytest.mark.parametrize("damping", [0.1, 0.85])
@pytest.mark.parametrize("n", [120, 3000])
def test_a_question_has_the_same_bits_alone_and_in_any_batch(damping: float, n: int) -> None:
    """Each question converges on its own and every sum over nodes is its own, so its row is the same bits
    alone, in the whole batch, in a reversed subset: what lets the rank stage rank questions in chunks under
    the exact PPR. Questions that converge at different iterations (reset rows of very different spreads),
    dangling nodes, an all-zero row. The kernel before (sums over axis 0, one convergence test for the
    batch) failed this: its rows moved with the batch."""
    rng = np.random.default_rng(n)
    s, t = random_graph(rng, n, 3 * n, n_isolated=n // 12)
    A = build_csr(s, t, n)
    R = rng.random((7, n)) * (rng.random((7, n)) < np.array([0.002, 0.01, 0.05, 0.2, 0.5, 0.9, 1.0])[:, None])
    R[0] = 0.0
    R[1, -1] = 1.0  # a dangling seed
    whole = personalized_pagerank(A, R, damping)
    assert whole[0].sum() == 0 and whole[1:].sum(axis=1) == pytest.approx(1.0)
    for i in range(R.shape[0]):
        np.testing.assert_array_equal(personalized_pagerank(A, R[i : i + 1], damping)[0], whole[i])
    sub = [6, 3, 1, 0]
    np.testing.assert_array_equal(personalized_pagerank(A, R[sub], damping), whole[sub])


@pytest.mark.gpu
def test_ppr_gpu_matches_cpu() -> None:
    from memgas.kernels.backend import get_xp, to_host

    if get_xp("auto")[1] != "cuda":
        pytest.skip("CuPy/CUDA not available")
    rng = np.random.default_rng(0)
    s, t = random_graph(rng, 500, 2000, 20)
    A = build_csr(s, t, 500)
    R = rng.random((64, 500))
    np.testing.assert_allclose(to_host(personalized_pagerank(A, R, 0.1, device="cuda")),
                               personalized_pagerank(A, R, 0.1), atol=1e-9)
    # the device path reads the convergence test every CHECK_EVERY["cuda"] iterations: same result as every one
    from memgas.kernels import ppr

    blocked = to_host(personalized_pagerank(A, R, 0.85, device="cuda"))
    old = ppr.CHECK_EVERY["cuda"]
    ppr.CHECK_EVERY["cuda"] = 1
    try:
        np.testing.assert_array_equal(to_host(personalized_pagerank(A, R, 0.85, device="cuda")), blocked)
    finally:
        ppr.CHECK_EVERY["cuda"] = old
