"""memgas-cards' ranking (pipeline/card_graph.py): the router's entropy setting, the cards that ranked a session."""

from __future__ import annotations

import numpy as np
import pytest

from memgas.kernels.router import entropy_router
from memgas.pipeline.card_graph import CARD, build_card_graph, rank_card_graph
from memgas.pipeline.retrieve import seed_reset


def _graph(seed: int = 0):  # noqa: ANN202
    """Three sessions of four MemGAS nodes, with 5, 0 and 12 cards; two queries; no edges."""
    rng = np.random.default_rng(seed)
    d = 8
    def unit(n: int) -> np.ndarray:  # unit vectors, as the encoder's
        x = rng.normal(size=(n, d))
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    pos = np.array([0] * 5 + [2] * 12)
    return build_card_graph(unit(12), pos, unit(len(pos))), unit(2)


def test_entropy_setting_reaches_the_router() -> None:
    """``entropy="normalised"`` (the default, as ``retrieval.card_graph_entropy``'s) ranks with the router's
    log N_g entropies, whose reset puts more mass on the cards (17 cards against 3 nodes of each MemGAS
    granularity) than "raw"'s."""
    from memgas.pipeline.config import RetrievalConfig

    g, q = _graph()
    none = np.zeros(0, np.int64)
    kw = dict(num_seeds=4, damping=0.1, temp=0.2, router="paper")
    default = rank_card_graph(g, q, none, none, **kw)
    norm_order, norm_scores = rank_card_graph(g, q, none, none, **kw, entropy="normalised")
    assert RetrievalConfig().card_graph_entropy == "normalised"
    assert np.array_equal(default[0], norm_order) and np.array_equal(default[1], norm_scores)
    raw = rank_card_graph(g, q, none, none, **kw, entropy="raw")
    sims = q.astype(np.float64) @ g.nodes.astype(np.float64).T
    parts = [sims[:, g.gran == i] for i in range(CARD + 1)]
    mass = {}
    for s in (False, True):
        w, _ = entropy_router(parts, temp=0.2, rule="paper", normalise=s)
        reset = seed_reset(sims * w[:, g.gran], 4)
        mass[s] = reset[:, g.gran == CARD].sum(1) / reset.sum(1)
    assert (mass[True] > mass[False]).all()
    assert not np.array_equal(norm_scores, raw[1])


def test_unknown_entropy_setting_is_refused() -> None:
    g, q = _graph()
    none = np.zeros(0, np.int64)
    with pytest.raises(ValueError, match="entropy must be 'raw' or 'normalised'"):
        rank_card_graph(g, q, none, none, num_seeds=4, damping=0.1, temp=0.2, router="paper", entropy="log")


def test_the_picks_are_the_cards_of_most_ppr_mass_of_each_top_session() -> None:
    """``session_card_picks``: per query, of each of its top sessions in rank order, the cards whose PPR mass
    (:func:`card_graph_ppr`, the values its session's score sums) is positive, most mass first (ties by node id),
    at most ``per_session``; against a plain loop over the same masses."""
    from memgas.pipeline.card_graph import card_graph_ppr, session_card_picks

    g, q = _graph(1)
    cards = np.flatnonzero(g.gran == CARD)
    # edges between cards of sessions 0 and 2 and one MemGAS node (src the later node): mass reaches cards
    # that are not seeds, and some card stays at zero
    src = np.array([cards[6], cards[7], cards[8], cards[9], cards[12], 9])
    dst = np.array([cards[0], cards[0], cards[1], cards[1], 0, 4])
    kw = dict(num_seeds=8, damping=0.3, temp=0.2, router="paper")
    order, scores, mass = card_graph_ppr(g, q, src, dst, **kw)
    assert all(np.array_equal(a, b) for a, b in zip(rank_card_graph(g, q, src, dst, **kw), (order, scores)))
    for s in range(g.n_sessions):  # a session's score is the sum of its nodes' mass, cards included
        assert np.array_equal(scores[:, s], mass[:, g.session == s].sum(1))
    for top, per in ((3, 3), (2, 20), (1, 0)):
        got = session_card_picks(g, order, mass, top, per)
        for qi, (ranks, nodes) in enumerate(got):
            want = []
            for r, s in enumerate(order[qi, :top]):
                mine = [n for n in cards if g.session[n] == s and mass[qi, n] > 0]
                want += [(r, n) for n in sorted(mine, key=lambda n: (-mass[qi, n], n))[:per]]
            assert list(zip(ranks.tolist(), nodes.tolist())) == want, (top, per, qi)
    # the cap binds (6 cards of session 2 have mass for query 0) and some cards have none
    assert max(np.bincount(r).max() for r, _ in session_card_picks(g, order, mass, 3, 20)) > 3
    assert all((mass[qi, cards] == 0).any() for qi in range(len(q)))
