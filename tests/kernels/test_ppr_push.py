"""Forward-push PPR (kernels/ppr_push.py) against the exact kernel (kernels/ppr.py): the error bound, the limit
epsilon -> 0, the exact kernel's edge cases, batch invariance, and top-10 agreement on real LoCoMo vectors."""
from __future__ import annotations

import numpy as np
import pytest

from memgas.kernels.ppr import build_csr, personalized_pagerank
from memgas.kernels.ppr_push import personalized_pagerank_push
from tests.fixtures.locomo_minilm import locomo_minilm_histories

#: the exact kernel stops at an L1 change < 1e-12, so it is itself that far from the fixed point
EXACT_SLACK = 1e-11


def _graph_and_resets(seed: int, n: int = 150, e: int = 400, n_isolated: int = 10, q: int = 12):
    """A random graph whose last ``n_isolated`` nodes have no edge; resets with sparse seeds, isolated seeds,
    seeds only on isolated nodes, and an all-zero row."""
    rng = np.random.default_rng(seed)
    s, t = rng.integers(0, n - n_isolated, e), rng.integers(0, n - n_isolated, e)
    A = build_csr(s, t, n)
    R = rng.random((q, n)) * (rng.random((q, n)) < 0.1)
    R[0] = 0.0
    R[1, -3:] = 1.0  # isolated seeds among connected ones
    R[2] = 0.0
    R[2, -2:] = [1.0, 3.0]  # isolated seeds only
    return A, R


@pytest.mark.parametrize("damping", [0.1, 0.5, 0.85])
@pytest.mark.parametrize("epsilon", [1e-3, 1e-5, 1e-7])
def test_push_is_below_exact_within_epsilon_times_degree(damping: float, epsilon: float) -> None:
    A, R = _graph_and_resets(int(damping * 100))
    deg = np.asarray(A.sum(axis=1)).ravel()
    X = personalized_pagerank(A, R, damping)
    Y = personalized_pagerank_push(A, R, damping, epsilon=epsilon)
    gap = X - Y
    assert gap.min() >= -EXACT_SLACK
    assert np.all(gap <= epsilon * deg / (1 - damping) + EXACT_SLACK)
    assert not Y[0].any()  # all-zero reset row -> all-zero row, as the exact kernel
    isolated = deg == 0
    assert not Y[3:, isolated][R[3:, isolated] == 0].any()  # an isolated non-seed gets nothing
    np.testing.assert_allclose(Y[2, -2:], [0.25, 0.75], rtol=0, atol=1e-15)  # isolated seeds keep their share


def test_push_top10_equals_exact_on_random_graphs_at_small_epsilon() -> None:
    A, R = _graph_and_resets(3)
    X = personalized_pagerank(A, R, 0.1)
    Y = personalized_pagerank_push(A, R, 0.1, epsilon=1e-9)
    top = lambda M: np.argsort(-M, axis=1, kind="stable")[:, :10]  # noqa: E731
    np.testing.assert_array_equal(top(Y)[1:], top(X)[1:])


@pytest.mark.parametrize("damping", [0.1, 0.85])
def test_push_reaches_exact_in_the_limit(damping: float) -> None:
    A, R = _graph_and_resets(11)
    X = personalized_pagerank(A, R, damping)
    Y = personalized_pagerank_push(A, R, damping, epsilon=1e-12)
    assert np.abs(X - Y).max() <= 1e-9


@pytest.mark.parametrize("damping", [0.1, 0.3])
def test_empty_graph_gives_the_exact_kernels_bits(damping: float) -> None:
    """No edges: the normalised reset row, bit for bit (memgas-no-association ranks on such a graph)."""
    R = np.random.default_rng(2).random((20, 30))
    R[0] = 0.0
    A = build_csr([], [], 30)
    np.testing.assert_array_equal(personalized_pagerank_push(A, R, damping, epsilon=1e-4),
                                  personalized_pagerank(A, R, damping))


def test_same_bits_whatever_the_batch() -> None:
    A, R = _graph_and_resets(5, q=9)
    full = personalized_pagerank_push(A, R, 0.5, epsilon=1e-6)
    perm = np.random.default_rng(0).permutation(R.shape[0])
    np.testing.assert_array_equal(personalized_pagerank_push(A, R[perm], 0.5, epsilon=1e-6), full[perm])
    for q in range(R.shape[0]):
        np.testing.assert_array_equal(personalized_pagerank_push(A, R[q : q + 1], 0.5, epsilon=1e-6)[0], full[q])


def test_bad_arguments_are_refused() -> None:
    A, R = _graph_and_resets(1)
    for kw, msg in [(dict(damping=1.0, epsilon=1e-6), "damping"), (dict(damping=0.1, epsilon=0.0), "epsilon")]:
        with pytest.raises(ValueError, match=msg):
            personalized_pagerank_push(A, R, **kw)
    with pytest.raises(ValueError, match="non-negative"):
        personalized_pagerank_push(A, -R, 0.1, epsilon=1e-6)
    with pytest.raises(ValueError, match="reset must be"):
        personalized_pagerank_push(A, R[:, :-1], 0.1, epsilon=1e-6)


def test_locomo_top10_under_push_equals_exact_at_the_default_epsilon() -> None:
    """The issue's agreement goal on LoCoMo (10 histories, 500 questions, real MiniLM node vectors): the real
    association (default AssociationConfig), router and seeds (rank_history); the top-10 sessions, in order,
    under push at RetrievalConfig's default ppr_epsilon equal the exact PPR's on >= 99.9% of questions, for
    both graph methods that run PPR on stored edges."""
    from memgas.kernels.backend import one_blas_thread
    from memgas.pipeline.config import RetrievalConfig
    from memgas.pipeline.retrieve import rank_history

    eps = RetrievalConfig().ppr_epsilon
    methods = ["memgas", "memgas-no-gmm"]
    agree = {m: 0 for m in methods}
    total = 0
    with one_blas_thread():
        for nodes, qs, edges in locomo_minilm_histories():
            assert edges["gmm"][0].size > 0  # a real graph, not the empty-graph shortcut
            exact = rank_history(nodes, qs, edges, methods, ppr="exact")
            push = rank_history(nodes, qs, edges, methods, ppr="push", ppr_epsilon=eps)
            for m in methods:
                agree[m] += int((exact[m][0][:, :10] == push[m][0][:, :10]).all(axis=1).sum())
            total += qs.shape[0]
    assert total == 500
    for m in methods:
        assert agree[m] >= 0.999 * total, f"{m}: top-10 equal on {agree[m]}/{total} questions at epsilon {eps}"
