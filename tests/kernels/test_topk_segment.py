from __future__ import annotations

import numpy as np

from memgas.kernels.segment import segment_sum_contiguous
from memgas.kernels.topk import stable_argsort_desc, topk


def test_topk_matches_stable_sort_with_ties() -> None:
    rng = np.random.default_rng(0)
    v = rng.integers(0, 5, (50, 40)).astype(np.float32)  # many ties
    for k in (1, 5, 39, 40, 60):
        idx, val = topk(v, k)
        ref = np.argsort(-v, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(idx, ref)
        np.testing.assert_array_equal(val, np.take_along_axis(v, ref, 1))
    idx, _ = topk(v, 3, largest=False)
    np.testing.assert_array_equal(idx, np.argsort(v, axis=1, kind="stable")[:, :3])


def test_stable_argsort_desc() -> None:
    np.testing.assert_array_equal(stable_argsort_desc(np.array([[1.0, 3, 3, 0]])), [[1, 2, 0, 3]])


def test_segment_sum_contiguous() -> None:
    x = np.arange(24, dtype=float).reshape(2, 12)
    np.testing.assert_array_equal(segment_sum_contiguous(x, 4), x.reshape(2, 3, 4).sum(-1))
    rng = np.random.default_rng(2)  # values over many magnitudes: any other order of the adds rounds differently
    for g in (2, 3, 4, 5):
        for dtype in (np.float64, np.float32):
            v = (rng.standard_normal((3, g * 20000)) * np.exp(3 * rng.standard_normal((3, g * 20000)))).astype(dtype)
            got, want = segment_sum_contiguous(v, g), v.reshape(3, -1, g).sum(-1)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (g, dtype)


def test_kth_largest_equals_the_full_partition_ties_included() -> None:
    """The sampled k-th largest equals the full partition's on rows long enough to sample: distinct values, a
    few levels with thousands of ties each, every entry equal, the top k all at the end (the sample's bound
    then keeps most of the row), and negative zeros beside zeros."""
    from memgas.kernels.topk import KTH_SAMPLE_STRIDE, kth_largest

    rng = np.random.default_rng(3)
    n = 8 * 15 * KTH_SAMPLE_STRIDE + 17
    rows = [rng.standard_normal(n), rng.integers(0, 5, n).astype(np.float64), np.full(n, 0.25),
            np.concatenate([np.zeros(n - 40), np.arange(40.0)]), np.where(rng.random(n) < 0.5, -0.0, 0.0)]
    values = np.stack(rows)
    for k in (1, 15, 16, 100, 1000):
        want = -np.partition(-values, k - 1, axis=1)[:, k - 1 : k]
        got = kth_largest(values, k)
        assert got.shape == (len(rows), 1) and (got == want).all(), k
    small = rng.standard_normal((2, 50))  # too short to sample: the full partition
    assert (kth_largest(small, 7) == -np.partition(-small, 6, axis=1)[:, 6:7]).all()
