"""Segment sums: aggregate per-node values into per-group values (e.g. nodes -> sessions)."""
from __future__ import annotations

from typing import Any

import numpy as np

from memgas.kernels.backend import xp_of


def segment_sum_contiguous(values: Any, group_size: int) -> Any:
    """Sum consecutive blocks of ``group_size`` along the last axis: [..., G*group_size] -> [..., G].

    MemGAS stores a session's 4 nodes contiguously (node = 4*session + g), so this is a reshape + sum.
    """
    n = values.shape[-1]
    if n % group_size:
        raise ValueError(f"last axis {n} is not a multiple of group_size {group_size}")
    return values.reshape(values.shape[:-1] + (n // group_size, group_size)).sum(axis=-1)


def segment_sum(values: Any, segment_ids: Any, n_segments: int) -> Any:
    """Sum ``values`` [..., N] into ``n_segments`` groups given ``segment_ids`` [N] (any order).

    Implemented as a product with a sparse one-hot [N, n_segments] matrix (one BLAS-like pass for all
    rows; works identically with cupyx.scipy.sparse).
    """
    xp = xp_of(values)
    ids = xp.asarray(segment_ids).astype(xp.int64)
    n = values.shape[-1]
    if xp is np:
        import scipy.sparse as sp  # noqa: PLC0415
    else:
        import cupyx.scipy.sparse as sp  # noqa: PLC0415
    onehot = sp.csr_matrix(
        (xp.ones(n, dtype=values.dtype), (xp.arange(n), ids)), shape=(n, n_segments)
    )
    flat = values.reshape(-1, n)
    out = xp.asarray((onehot.T @ flat.T).T)
    return out.reshape(values.shape[:-1] + (n_segments,))
