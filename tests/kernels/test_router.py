"""Entropy router vs a direct float64 formula."""
from __future__ import annotations

import numpy as np
import pytest

from memgas.kernels.router import entropy_router


def direct(sims: list[np.ndarray], temp: float, rule: str) -> tuple[np.ndarray, np.ndarray]:
    H = []
    for s in sims:
        H.append([-sum(p * np.log(p) for p in np.exp(r / temp) / np.exp(r / temp).sum() if p > 0) for r in s])
    H = np.array(H).T
    num = 1 / H if rule == "paper" else 1 - H
    return num / num.sum(1, keepdims=True), H


@pytest.mark.parametrize("rule", ["paper", "reference"])
def test_matches_direct_formula(rule: str) -> None:
    rng = np.random.default_rng(0)
    sims = [rng.normal(0.3, 0.15, (9, n)) for n in (12, 12, 7, 30)]
    w, H = entropy_router(sims, temp=0.2, rule=rule)
    w2, H2 = direct(sims, 0.2, rule)
    np.testing.assert_allclose(H, H2, rtol=1e-10)
    np.testing.assert_allclose(w, w2, rtol=1e-9)
    # stacked [G, Q, N] with a mask gives the same as the list form
    G, Q, N = 4, 9, 30
    A = np.zeros((G, Q, N))
    mask = np.zeros((G, N), bool)
    for g, s in enumerate(sims):
        A[g, :, : s.shape[1]] = s
        mask[g, : s.shape[1]] = True
    w3, H3 = entropy_router(A, mask=mask, temp=0.2, rule=rule)
    np.testing.assert_allclose(w3, w, rtol=1e-9)


def test_reference_rule_sign_inversion() -> None:
    rng = np.random.default_rng(1)
    sims = [rng.normal(0.3, 0.02, (3, 50)), rng.normal(0.3, 0.3, (3, 50))]  # flat vs peaked
    w_ref, H = entropy_router(sims, temp=0.2, rule="reference")
    w_pap, _ = entropy_router(sims, temp=0.2, rule="paper")
    assert (H > 1).all() and (H[:, 0] > H[:, 1]).all()
    # paper: the peaked (low-entropy) granularity wins; reference: the flat (high-entropy) one does
    assert (w_pap[:, 1] > w_pap[:, 0]).all()
    assert (w_ref[:, 0] > w_ref[:, 1]).all()
    np.testing.assert_allclose(w_ref, (1 - H) / (1 - H).sum(1, keepdims=True))


def test_zero_entropy_guard() -> None:
    one = [np.array([[0.5]]), np.array([[0.1]]), np.array([[0.9]]), np.array([[0.2]])]
    for rule in ("paper", "reference"):
        w, H = entropy_router(one, temp=0.2, rule=rule)
        assert (H == 0).all()
        np.testing.assert_allclose(w, 0.25)  # all H = 0: equal weights
    w, _ = entropy_router([np.array([[0.5]]), np.array([[0.1, 0.3]])], temp=0.2, rule="paper")
    assert w[0, 0] > 0.999  # a zero-entropy granularity takes (almost) all the weight
    assert np.isfinite(w).all()


@pytest.mark.parametrize("rule", ["paper", "reference"])
def test_five_granularities_one_empty_is_the_four_weights(rule: str) -> None:
    """memgas-cards routes over five granularities whose node counts differ (a history's cards are not one per
    session); a history whose sessions gave no card has an empty fifth granularity: it gets weight 0 and the
    other four get exactly their four-granularity weights (before, the empty one raised ValueError)."""
    rng = np.random.default_rng(2)
    four = [rng.normal(0.3, 0.15, (5, 6)) for _ in range(4)]
    cards = rng.normal(0.3, 0.15, (5, 23))
    w5, H5 = entropy_router([*four, cards], temp=0.2, rule=rule)
    w, H = direct([*four, cards], 0.2, rule)
    np.testing.assert_allclose(H5, H, rtol=1e-10)
    np.testing.assert_allclose(w5, w, rtol=1e-9)
    w4, H4 = entropy_router(four, temp=0.2, rule=rule)
    w0, H0 = entropy_router([*four, np.zeros((5, 0))], temp=0.2, rule=rule)
    assert w0.shape == (5, 5) and (w0[:, 4] == 0).all() and (H0[:, 4] == 0).all()
    assert np.array_equal(w0[:, :4], w4) and np.array_equal(H0[:, :4], H4)


@pytest.mark.parametrize("rule", ["paper", "reference"])
def test_normalised_entropy_is_divided_by_log_n(rule: str) -> None:
    """``normalise``: each granularity's entropy over its maximum, log N_g (list and stacked forms alike; an
    empty granularity still gets weight 0)."""
    rng = np.random.default_rng(3)
    sims = [rng.normal(0.3, 0.15, (5, n)) for n in (6, 6, 6, 6, 40)]
    _, H = entropy_router(sims, temp=0.2, rule=rule)
    w, Hn = entropy_router(sims, temp=0.2, rule=rule, normalise=True)
    assert np.array_equal(Hn, H / np.log(np.array([6.0, 6.0, 6.0, 6.0, 40.0])))
    assert ((Hn > 0) & (Hn <= 1)).all()
    A = np.zeros((5, 5, 40))
    mask = np.zeros((5, 40), bool)
    for g, s in enumerate(sims):
        A[g, :, : s.shape[1]] = s
        mask[g, : s.shape[1]] = True
    w3, H3 = entropy_router(A, mask=mask, temp=0.2, rule=rule, normalise=True)
    np.testing.assert_allclose(H3, Hn, rtol=1e-12)
    np.testing.assert_allclose(w3, w, rtol=1e-12)
    w0, H0 = entropy_router([*sims[:4], np.zeros((5, 0))], temp=0.2, rule=rule, normalise=True)
    w4, H4 = entropy_router(sims[:4], temp=0.2, rule=rule, normalise=True)
    assert (w0[:, 4] == 0).all() and (H0[:, 4] == 0).all()
    assert np.array_equal(w0[:, :4], w4) and np.array_equal(H0[:, :4], H4)


def test_normalised_entropy_lifts_a_many_node_granularity_and_keeps_equal_sizes() -> None:
    """Paper rule: granularities of one size (MemGAS's four) keep their weights; a granularity of many more
    nodes (memgas-cards' cards), whose raw entropy is large for its size alone, gains weight on every query."""
    rng = np.random.default_rng(4)
    four = [rng.normal(0.3, 0.15, (7, 6)) for _ in range(4)]
    cards = rng.normal(0.3, 0.15, (7, 40))
    w_raw, _ = entropy_router(four, temp=0.2, rule="paper")
    w_norm, _ = entropy_router(four, temp=0.2, rule="paper", normalise=True)
    np.testing.assert_allclose(w_norm, w_raw, rtol=1e-12)
    w_raw, _ = entropy_router([*four, cards], temp=0.2, rule="paper")
    w_norm, _ = entropy_router([*four, cards], temp=0.2, rule="paper", normalise=True)
    assert (w_norm[:, 4] > w_raw[:, 4]).all()
    # the four keep their ratios to one another: only the cards' share moved
    np.testing.assert_allclose(w_norm[:, :4] / w_norm[:, :1], w_raw[:, :4] / w_raw[:, :1], rtol=1e-12)
