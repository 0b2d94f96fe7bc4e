"""Exact causal search on sparse row sets: rows of different tiles packed into one query block give the
bits of each row computed alone on its own tile (pipeline/association/exact_search.py)."""
from __future__ import annotations

import numpy as np
import pytest

from memgas.pipeline.association import exact_search as X
from memgas.pipeline.association.nodes import N_GRAN


def _nodes(seed: int, n_sessions: int, d: int, ties: bool) -> np.ndarray:
    """Normalised random vectors with exact duplicates (equal scores at other node ids), or small
    integers (exact dot products: ties everywhere)."""
    rng = np.random.default_rng(seed)
    n = n_sessions * N_GRAN
    if ties:
        return rng.integers(-1, 2, size=(n, d)).astype(np.float32)
    E = rng.normal(size=(n, d)).astype(np.float32)
    E /= np.linalg.norm(E, axis=1, keepdims=True)
    src = rng.choice(n, size=n // 5, replace=False)
    E[rng.choice(n, size=src.size, replace=False)] = E[src]
    return E


def _sample(seed: int, n: int, T: int, size: int) -> np.ndarray:
    """Random rows plus the cases that matter: rows of the same tile, one slot in several tiles, rows of
    the first tile (prefixes shorter than k, session 0 with none)."""
    rng = np.random.default_rng(seed + 100)
    extra = [1, 5, 9, 14, T - 1, T + 3, 3 * T + 3, (n // T - 1) * T + 3, n - 1, n - 2, n - T]
    rows = np.concatenate([rng.choice(n, size=size, replace=False), extra])
    return np.unique(rows[(rows >= 0) & (rows < n)]).astype(np.int64)


def _alone(E: np.ndarray, rows: np.ndarray, k: int, bs: int, cc: int) -> tuple[np.ndarray, np.ndarray]:
    """The oracle: each row by itself, on its own tile (the per-tile path)."""
    out = [X._causal_candidates(E, rows[i : i + 1], k, "cpu", bs, cc, pack=False) for i in range(rows.size)]
    return np.concatenate([c for c, _ in out]), np.concatenate([v for _, v in out])


@pytest.mark.parametrize("seed,n_sessions,d,ties,bs,cc,size", [
    (0, 200, 16, False, 4, 100, 40),   # T = 16: 50 tiles, prefixes up to 796 > 7 column chunks
    (1, 200, 16, True, 4, 64, 60),
    (2, 150, 8, True, 3, 37, 30),      # odd tile and chunk sizes
    (3, 160, 12, False, 2, 1 << 16, 50),  # one column chunk
    (4, 1536, 16, False, 64, 2048, 120),  # production tile (T = 256): 24 tiles, 3 column chunks
])
def test_packed_rows_equal_each_row_alone(seed: int, n_sessions: int, d: int, ties: bool, bs: int, cc: int,
                                          size: int) -> None:
    E = _nodes(seed, n_sessions, d, ties)
    T = bs * N_GRAN
    rows = _sample(seed, E.shape[0], T, size)
    k = 10
    blocks = X._query_blocks(rows, T, pack=True)
    assert len(blocks) < np.unique(rows // T).size  # the sample is packed: fewer products than tiles
    for pos in blocks:  # a block never holds two rows at one slot
        assert np.unique(rows[pos] % T).size == pos.size
    got_c, got_v = X._causal_candidates(E, rows, k, "cpu", bs, cc)
    ref_c, ref_v = _alone(E, rows, k, bs, cc)
    assert np.array_equal(got_v, ref_v)
    assert np.array_equal(got_c, ref_c)
    assert got_v[rows >= T].any(axis=1).all()  # rows past the first tile do see candidates
    # the per-tile path on the same row set (the code before packing) agrees as well
    old_c, old_v = X._causal_candidates(E, rows, k, "cpu", bs, cc, pack=False)
    assert np.array_equal(old_c, got_c) and np.array_equal(old_v, got_v)


def test_dense_and_mixed_row_sets_keep_their_tiles() -> None:
    """Whole tiles are never packed (their lower triangle stays); a sample next to dense tiles is packed
    among itself, and every row still gets its own bits."""
    T = 16
    dense = np.arange(5 * T, 9 * T, dtype=np.int64)
    tiles = X._query_blocks(dense, T, pack=True)
    assert [p.tolist() for p in tiles] == [p.tolist() for p in X._query_blocks(dense, T, pack=False)]
    E = _nodes(5, 200, 16, False)
    sample = np.array([7, T + 9, 2 * T + 1, 3 * T + 2, 11 * T + 7, 30 * T + 1, 40 * T + 5, 49 * T + 2])
    rows = np.union1d(sample, dense)
    blocks = X._query_blocks(rows, T, pack=True)
    assert len(blocks) == 4 + 2  # the 4 whole tiles, the 8 sample rows in 2 packs (slots 1, 2 and 7 twice)
    got = X._causal_candidates(E, rows, 10, "cpu", 4, 100)
    ref = _alone(E, rows, 10, 4, 100)
    assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1])


def test_packing_only_where_it_saves_columns() -> None:
    """Two rows, an early one and a late one at another slot: packing them runs the early row over the
    late prefix but saves a product (kept); rows that would only share the latest tile's prefix twice
    are not packed."""
    T = 16
    assert len(X._query_blocks(np.array([T + 1, 40 * T + 2]), T, pack=True)) == 1
    # late tile rows at slots 1 and 2, an early row at slot 1: greedy packs {early 1, late 2} and {late 1}
    # (twice the late prefix) against the tiles' early + late prefix: not packed
    rows = np.array([T + 1, 40 * T + 1, 40 * T + 2])
    assert len(X._query_blocks(rows, T, pack=True)) == 2


class _Spy(np.ndarray):
    """An array whose products are recorded (query block, column block) before NumPy computes them."""

    log: list[tuple[np.ndarray, np.ndarray]] = []

    def __matmul__(self, other: np.ndarray) -> np.ndarray:
        _Spy.log.append((np.asarray(self), np.asarray(other)))
        return np.asarray(self) @ np.asarray(other)


class _SpyNumpy:
    """NumPy, except that ``asarray`` gives :class:`_Spy` arrays."""

    def __getattr__(self, name: str) -> object:
        return getattr(np, name)

    @staticmethod
    def asarray(a: object) -> np.ndarray:
        return np.asarray(a).view(_Spy)


def test_every_product_is_canonical_with_each_row_at_its_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shapes the bits rest on, checked directly (this BLAS may give a row the same bits at any place
    of the block, so a wrong place would not show in the candidates): every product is a [T, d] query
    block times a column block padded to COL_PAD, and each asked row sits in exactly one query block,
    at its slot row % T, with zero rows everywhere else."""
    bs, cc, d = 4, 100, 16
    T = bs * N_GRAN
    E = np.random.default_rng(7).normal(size=(200 * N_GRAN, d)).astype(np.float32)  # distinct rows
    rows = _sample(7, E.shape[0], T, 60)
    monkeypatch.setattr(X, "get_xp", lambda device: (_SpyNumpy(), device))
    _Spy.log = []
    X._causal_candidates(E, rows, 10, "cpu", bs, cc)
    assert len(X._query_blocks(rows, T, pack=True)) < np.unique(rows // T).size
    seen: dict[int, int] = {}
    for q, cols in _Spy.log:
        assert q.shape == (T, d) and cols.shape[0] == d and cols.shape[1] % X.COL_PAD == 0
        key = id(q.base) if q.base is not None else id(q)
        for s in np.flatnonzero(np.abs(q).sum(1)):
            r = rows[(rows % T == s) & (E[rows] == q[s]).all(1)]
            assert r.size == 1, f"slot {s} holds no asked row of that slot"
            assert seen.setdefault(int(r[0]), key) == key, f"row {int(r[0])} in two query blocks"
    # every row that sees a node is in a product (rows of session 0 only where their tile is computed)
    assert set(rows[rows >= N_GRAN].tolist()) <= set(seen)
