"""The associate stage's IVF search (``ivf_search.ivf_rows``, issue 29) on seeded synthetic vectors."""

from __future__ import annotations

import numpy as np
import pytest

from memgas.pipeline.association import ivf_search as I
from memgas.pipeline.association.exact_search import causal_rows
from memgas.pipeline.synth_vectors import clustered_nodes


@pytest.mark.parametrize("cut", [90, 96, 121])  # inside a grid block, on its edge, and in the next one
def test_rows_over_a_saved_index_equal_a_fresh_build_byte_for_byte(monkeypatch: pytest.MonkeyPatch, cut: int) -> None:
    """A history indexed to ``cut`` sessions, its index saved to bytes and loaded, then its later rows:
    the candidates (ids, scores) of one build over all 130 sessions, and the same saved index bytes; the
    exact prefix's rows are the exact search's."""
    monkeypatch.setattr(I, "STAGE_BLOCK_SESSIONS", 16)
    S, n0 = 130, 160
    E = clustered_nodes(0, S, dim=32, n_topics=20, seed=3)
    p = I.stage_params(8, 2, n0)
    fresh, ix_fresh = I.ivf_rows(E, 0, 4 * S, None, params=p)
    first, ix = I.ivf_rows(E[: 4 * cut], 0, 4 * cut, None, params=p)
    assert ix.ntotal == 4 * I.index_sessions(cut)
    loaded = I.index_from_bytes(I.index_bytes(ix).tobytes(), p, d=32, ntotal=ix.ntotal)
    rest, ix_rest = I.ivf_rows(E, 4 * cut, 4 * S, loaded, params=p)
    both = I._concat([first, rest], 30)
    for f in ("rows", "cand", "valid", "scores"):
        assert np.array_equal(getattr(both, f), getattr(fresh, f)), f
    assert np.array_equal(I.index_bytes(ix_rest), I.index_bytes(ix_fresh))
    exact = causal_rows(E, 0, 4 * S)
    m = fresh.rows < n0
    assert np.array_equal(exact.cand[m], fresh.cand[m]) and np.array_equal(exact.scores[m], fresh.scores[m])
    assert not np.array_equal(exact.cand[~m], fresh.cand[~m]), "2 of 8 lists probed gave the exact candidates"


def test_a_stored_index_that_is_not_what_its_row_says_is_refused() -> None:
    E = clustered_nodes(0, 60, dim=32, n_topics=20, seed=1)
    p = I.stage_params(4, 1, 160)
    _, ix = I.ivf_rows(E, 0, 240, None, params=p)
    data = I.index_bytes(ix).tobytes()
    with pytest.raises(ValueError, match="expected an IVF index of 64 of 32"):
        I.index_from_bytes(data, p, d=32, ntotal=64)


def test_near_ties_below_the_sq8_resolution_still_give_a_fresh_builds_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node within 1e-3 of one vector: the SQ8 store cannot order them, so which 45 the index
    fetches is arbitrary, while a block's own earlier nodes are fetched by exact scores. With the library's
    free block boundaries an append put A's last sessions in the index where a fresh build had them in the
    block, and the candidates of the appended rows differed; on the stage's grid they are the same."""
    monkeypatch.setattr(I, "STAGE_BLOCK_SESSIONS", 16)
    rng = np.random.default_rng(7)
    base = rng.normal(size=32)
    E = (base / np.linalg.norm(base) + 1e-3 * rng.normal(size=(4 * 40, 32))).astype(np.float32)
    E /= np.linalg.norm(E, axis=1, keepdims=True)
    p = I.stage_params(2, 1, 80)
    fresh, _ = I.ivf_rows(E, 0, 160, None, params=p)
    _, ix = I.ivf_rows(E[:120], 0, 120, None, params=p)
    rest, _ = I.ivf_rows(E, 120, 160, I.index_from_bytes(I.index_bytes(ix).tobytes(), p, d=32, ntotal=ix.ntotal),
                         params=p)
    m = fresh.rows >= 120
    assert np.array_equal(rest.cand, fresh.cand[m]) and np.array_equal(rest.scores, fresh.scores[m])
