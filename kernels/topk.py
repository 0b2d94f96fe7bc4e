"""Batched top-k along the last axis (NumPy/CuPy generic)."""
from __future__ import annotations

from typing import Any

import numpy as np

from memgas.kernels.backend import xp_of


def topk(values: Any, k: int, largest: bool = True) -> tuple[Any, Any]:
    """Top ``k`` entries of each row of ``values`` [..., N]: (indices, values), best first.

    argpartition picks the k best in O(N); a stable sort of the picked keys then orders them. Ties are
    broken by the lower index: the partition step works on a composite key (value, -index) via a
    lexicographic stable sort, so a tie at the k-th boundary also keeps the lower indices.
    """
    xp = xp_of(values)
    n = values.shape[-1]
    k = max(0, min(int(k), n))
    key = -values if largest else values
    if k == 0:
        shape = values.shape[:-1] + (0,)
        return xp.zeros(shape, dtype=xp.int64), xp.zeros(shape, dtype=values.dtype)
    if k < n:
        # k-th value per row; keep everything strictly better plus the lowest-index ties
        part = xp.argpartition(key, k - 1, axis=-1)
        kth = xp.take_along_axis(key, part[..., k - 1 : k], axis=-1)
        better = key < kth
        tie = key == kth
        need = k - better.sum(axis=-1, keepdims=True)
        if bool((tie.sum(axis=-1, keepdims=True) == need).all()):
            chosen = better | tie  # common case: no surplus ties at the boundary, skip the cumsum
        else:
            tie_rank = xp.cumsum(tie, axis=-1)  # 1-based rank among ties, in index order
            chosen = better | (tie & (tie_rank <= need))
        # chosen has exactly k True per row: nonzero walks rows in order, so a reshape gives each row's
        # k column indices in increasing order (no sort over N needed)
        idx = xp.nonzero(chosen.reshape(-1, n))[1].reshape(values.shape[:-1] + (k,))
    else:
        idx = xp.broadcast_to(xp.arange(n), values.shape).copy()
    sub = xp.take_along_axis(key, idx, axis=-1)
    # stable sort keeps index order among equal values (idx is increasing within each row)
    o = xp.argsort(sub, axis=-1, kind="stable") if xp.__name__ == "numpy" else xp.argsort(sub, axis=-1)
    idx = xp.take_along_axis(idx, o, axis=-1)
    return idx.astype(xp.int64), xp.take_along_axis(values, idx, axis=-1)


def stable_argsort_desc(values: Any) -> Any:
    """Indices sorting each row descending; ties by lower index (NaN-free input expected)."""
    xp = xp_of(values)
    if xp.__name__ == "numpy":
        return xp.argsort(-values, axis=-1, kind="stable").astype(xp.int64)
    return xp.argsort(-values, axis=-1).astype(xp.int64)  # CuPy's argsort is a stable radix sort


#: :func:`kth_largest` first takes the k-th largest of every KTH_SAMPLE_STRIDE-th entry of a row (a lower bound)
KTH_SAMPLE_STRIDE = 64


def kth_largest(values: Any, k: int) -> Any:
    """The ``k``-th largest entry of each row of ``values`` [Q, N], as [Q, 1] (``1 <= k <= N``): the value
    ``-partition(-values, k - 1)[:, k - 1]`` gives, without partitioning every entry on the host. The k-th
    largest of a strided sample of the row is at most the row's, so every entry at least the row's k-th
    largest is among the entries at least the sample's (about ``k * KTH_SAMPLE_STRIDE`` of them); the k-th
    largest of those is the row's. Ties change nothing: the value is the same whichever tied entry holds it."""
    xp = xp_of(values)
    n = values.shape[-1]
    if xp.__name__ != "numpy" or n < 4 * k * KTH_SAMPLE_STRIDE:
        return xp.partition(values, n - k, axis=-1)[..., n - k : n - k + 1]
    out = np.empty((values.shape[0], 1), values.dtype)
    for i, row in enumerate(values):
        sample = row[::KTH_SAMPLE_STRIDE]
        bound = np.partition(sample, sample.size - k)[sample.size - k]
        cand = row[row >= bound]
        out[i, 0] = np.partition(cand, cand.size - k)[cand.size - k]
    return out
