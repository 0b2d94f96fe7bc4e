"""memgas-cards (pipeline/card_graph.py): the router's entropy setting, the cards that ranked a session, the
candidate search against its dense reference."""

from __future__ import annotations

import numpy as np
import pytest

from memgas.kernels.router import entropy_router
from memgas.pipeline.card_graph import (CARD, build_card_graph, card_graph_candidates, dense_card_graph_candidates,
                                        rank_card_graph)
from memgas.pipeline.retrieve import seed_reset
from memgas.pipeline.schema import N_GRAN


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


def _cards_graph(sessions: int, seed: int = 0):  # noqa: ANN202
    """``sessions`` sessions with 0 to 9 cards each (some sessions without), 16 dimensions."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N_GRAN * sessions + 9 * sessions, 16))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    pos = np.repeat(np.arange(sessions), rng.integers(0, 10, sessions))
    return build_card_graph(x[: N_GRAN * sessions], pos, x[N_GRAN * sessions : N_GRAN * sessions + pos.size])


@pytest.mark.parametrize("min_prior_nodes", [0, 20, 57])
def test_blocked_candidates_equal_the_dense_search(min_prior_nodes: int) -> None:
    """The blocked causal search (MemGAS's, each row's prefix given by its session's first node) gives the dense
    reference's candidates, validity and float64 scores exactly, over more than one 256-row tile; and the rows
    of a session range alone (a segment) are those rows of the whole graph's result."""
    g = _cards_graph(90)
    assert g.nodes.shape[0] > 2 * 256 and g.n_cards > 0
    kw = dict(mem_threshold=12, min_prior_nodes=min_prior_nodes)
    got, ref = card_graph_candidates(g, **kw), dense_card_graph_candidates(g, **kw)
    assert ref.rows.size > 0
    for f in ("rows", "cand", "valid", "scores"):
        assert np.array_equal(getattr(got, f), getattr(ref, f)), f
    for a, b in ((0, 31), (31, 90), (45, 46)):
        part = card_graph_candidates(g, **kw, sessions=(a, b))
        sel = (ref.rows >= g.starts[a]) & (ref.rows < (g.starts[b] if b < g.n_sessions else g.nodes.shape[0]))
        for f in ("rows", "cand", "valid", "scores"):
            assert np.array_equal(getattr(part, f), getattr(ref, f)[sel]), (a, b, f)


def test_past_the_exact_prefix_ivf_equals_the_exact_search_where_the_recall_sample_says_so() -> None:
    """Under the IVF search, the rows below the exact prefix are the exact search's; past it, every row whose
    recall is whole (all its exact candidates found) has the exact search's candidates and scores; and a
    segment's rows alone get the candidates the whole graph's walk gives them (append equals fresh)."""
    from memgas.pipeline.association import exact_search
    from memgas.pipeline.association.ivf_search import IVFParams
    from memgas.pipeline.card_graph_ivf import card_graph_ivf_candidates, card_graph_recall, ivf_rows
    from memgas.pipeline.synth_vectors import clustered_nodes

    rng = np.random.default_rng(0)
    S = 150
    four = clustered_nodes(0, S, dim=32, n_topics=20, seed=3)  # clustered: the lists matter
    pos = np.repeat(np.arange(S), rng.integers(0, 8, S))
    c = four[N_GRAN * pos + rng.integers(0, N_GRAN, pos.size)] + rng.normal(0, 0.05, (pos.size, 32))
    g = build_card_graph(four, pos, (c / np.linalg.norm(c, axis=1, keepdims=True)).astype(np.float32))
    kw = dict(mem_threshold=12, min_prior_nodes=20)
    exact = card_graph_candidates(g, **kw)
    for nprobe in (2, 8):
        p = IVFParams(nlist=8, nprobe=nprobe, train_nodes=400, exact_nodes=400, threads=1, block_sessions=16)
        asked, search = [], exact_search._causal_candidates
        exact_search._causal_candidates = lambda E, rows, *a, **k: asked.append(rows) or search(E, rows, *a, **k)
        try:
            got = card_graph_ivf_candidates(g, **kw, params=p)
        finally:
            exact_search._causal_candidates = search
        assert asked and all(r.size == 0 or r.max() < 400 for r in asked), "the exact search: the prefix's rows only"
        assert np.array_equal(got.rows, exact.rows)
        pre = got.rows < 400
        for f in ("cand", "valid", "scores"):
            assert np.array_equal(getattr(got, f)[pre], getattr(exact, f)[pre]), f
        rows = ivf_rows(g, 20, p)
        assert rows.size > 300 and rows[0] >= 400
        hits, total = card_graph_recall(g, got, rows, 12)
        whole = hits == total
        at = np.searchsorted(got.rows, rows)
        same = np.array([np.array_equal(got.cand[j], exact.cand[j]) and np.array_equal(got.scores[j], exact.scores[j])
                         for j in at])
        assert np.array_equal(same, whole), nprobe
        assert whole.any() and (nprobe == 8 or not whole.all())  # few lists probed: some rows miss candidates
        for a, b in ((0, 60), (60, 150), (100, 101)):
            part = card_graph_ivf_candidates(g, **kw, params=p, sessions=(a, b))
            sel = (g.session[got.rows] >= a) & (g.session[got.rows] < b)
            for f in ("rows", "cand", "valid", "scores"):
                assert np.array_equal(getattr(got, f)[sel], getattr(part, f)), (nprobe, a, b, f)


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
