"""Batched GMM vs scikit-learn GaussianMixture (the oracle)."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning
from sklearn.mixture import GaussianMixture

from memgas.kernels.gmm import fit_gmm_1d
from memgas.pipeline.association import candidates

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "locomo_minilm_nodes.npz"


def sklearn_accept(x: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        g = GaussianMixture(n_components=2, covariance_type="full", random_state=0).fit(x[:, None])
    return g.predict(x[:, None]) == int(np.argmax(g.means_[:, 0]))


def compare(scores: np.ndarray, mask: np.ndarray) -> tuple[int, list[int]]:
    res = fit_gmm_1d(scores, mask)
    bad = [i for i in range(len(scores)) if not np.array_equal(sklearn_accept(scores[i][mask[i]]), res.accepted[i][mask[i]])]
    assert not res.accepted[~mask].any()
    return len(scores), bad


def test_locomo_rows_match_sklearn() -> None:
    f = np.load(FIXTURE, allow_pickle=False)
    nodes, off = f["nodes"].astype(np.float32), f["conv_offsets"]
    # min_prior_nodes=4 gives > 1000 rows and rows with 4..30 candidates (masks) from real MiniLM scores
    cs = [candidates(nodes[off[i] : off[i + 1]], min_prior_nodes=4) for i in range(len(off) - 1)]
    sc = np.concatenate([c.scores for c in cs])
    va = np.concatenate([c.valid for c in cs])
    n, bad = compare(sc, va)
    assert n >= 1000
    print(f"LoCoMo GMM rows: {n - len(bad)}/{n} identical accepted sets; mismatching rows: {bad}")
    assert (n - len(bad)) / n >= 0.995


def test_random_rows_match_sklearn() -> None:
    rng = np.random.default_rng(0)
    B, M = 160, 30
    rows = []
    for i in range(B):
        k = i % 4
        if k == 0:
            r = rng.normal(0.3, 0.1, M)
        elif k == 1:
            r = np.concatenate([rng.normal(0.2, 0.05, 20), rng.normal(0.6, 0.05, 10)])
        elif k == 2:
            r = rng.beta(2, 5, M)
        else:
            r = rng.exponential(0.1, M)
        rows.append(-np.sort(-r) if i % 2 else r)
    X = np.array(rows)
    mask = np.arange(M)[None, :] < rng.integers(3, M + 1, B)[:, None]
    mask[::7] = rng.random((len(mask[::7]), M)) < 0.6  # non-prefix masks
    mask[::7, :3] = True
    n, bad = compare(X, mask)
    assert len(bad) <= 1, bad


def test_degenerate_rows() -> None:
    X = np.array([[0.5] * 6, [0.1, 0.9, 0, 0, 0, 0], [0.3, 0.3, 0.3, 0.2, 0, 0], [0.7, 0, 0, 0, 0, 0]])
    mask = np.array([[True] * 6, [True, True] + [False] * 4, [True] * 3 + [False] * 3, [True] + [False] * 5])
    r = fit_gmm_1d(X, mask)
    # all-equal valid scores and single-score rows: nothing accepted, flagged degenerate, converged
    assert r.degenerate.tolist() == [True, False, True, True]
    assert not r.accepted[[0, 2, 3]].any()
    assert r.converged.all() and (r.n_iter[[0, 2, 3]] == 0).all()
    assert r.accepted[1].tolist() == [False, True, False, False, False, False]
    e = fit_gmm_1d(np.zeros((0, 30)))
    assert e.accepted.shape == (0, 30)


def test_result_fields() -> None:
    rng = np.random.default_rng(3)
    X = np.concatenate([rng.normal(0, 0.3, (50, 20)), rng.normal(5, 0.3, (50, 10))], axis=1)
    r = fit_gmm_1d(X)
    assert r.means.shape == r.variances.shape == r.weights.shape == (50, 2)
    np.testing.assert_allclose(r.weights.sum(1), 1.0)
    assert (r.accepted[:, 20:].all()) and not r.accepted[:, :20].any()


@pytest.mark.gpu
def test_gmm_gpu_matches_cpu() -> None:
    from memgas.kernels.backend import get_xp, to_host

    if get_xp("auto")[1] != "cuda":
        pytest.skip("CuPy/CUDA not available")
    rng = np.random.default_rng(1)
    X = rng.beta(2, 5, (2000, 30))
    a = fit_gmm_1d(X, device="cpu").accepted
    b = to_host(fit_gmm_1d(X, device="cuda").accepted)
    assert (a == b).all(axis=1).mean() >= 0.999
