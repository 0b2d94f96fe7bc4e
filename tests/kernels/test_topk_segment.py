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
