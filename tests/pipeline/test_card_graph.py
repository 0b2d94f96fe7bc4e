"""memgas-cards (pipeline/card_graph.py): the router's entropy setting; the candidate search against its dense
reference."""

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
