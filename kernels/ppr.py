"""Batched Personalized PageRank on an undirected graph (python-igraph ``prpack`` semantics).

For each query q with reset (personalisation) vector r_q (normalised to sum 1) we solve

    x = d * (A D^-1 x + (sum of x over dangling nodes) * r) + (1 - d) * r

where ``d`` = ``damping`` = probability of following an edge (igraph's and networkx's ``alpha`` meaning),
A is the symmetric 0/1 adjacency and D its degrees. Semantics checked empirically against
``igraph.Graph.personalized_pagerank(directed=False, implementation="prpack")`` (see tests):

- dangling / isolated nodes (degree 0) send their mass back through the reset vector (not uniformly);
  so an isolated seed keeps mass and an isolated non-seed gets 0;
- a graph without edges returns the normalised reset vector;
- an all-zero reset row returns an all-zero row (igraph raises "sum of the elements in the reset vector
  must not be zero"; in batches we prefer a defined, harmless answer);
- duplicate edges are merged and self-loops dropped by :func:`build_csr` (unweighted graph).

All Q queries run at once as sparse [N, N] x dense [N, Q] products (scipy on CPU, cupyx on GPU).
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import scipy.sparse as sp

from memgas.kernels.backend import get_xp, to_device

log = logging.getLogger(__name__)

#: iterations between host reads of the convergence test, per device ("cuda": one sync per block; the
#: result is the same for any value, see personalized_pagerank)
CHECK_EVERY = {"cpu": 1, "cuda": 16}


def build_csr(src: Any, dst: Any, n_nodes: int, index_dtype: Any = np.int32) -> sp.csr_matrix:
    """Symmetric unweighted adjacency (CSR, float64 data) from an undirected edge list.

    Each pair may appear in either direction and any number of times: duplicates are merged to one
    edge. Self-loops are dropped (MemGAS never creates them; igraph's degree convention for them
    differs from a plain symmetric matrix). ``index_dtype`` is int32 or int64.
    """
    src = np.asarray(src, dtype=np.int64).ravel()
    dst = np.asarray(dst, dtype=np.int64).ravel()
    if src.shape != dst.shape:
        raise ValueError(f"src and dst differ in length: {src.shape} vs {dst.shape}")
    if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= n_nodes):
        raise ValueError(f"edge endpoint outside [0, {n_nodes})")
    keep = src != dst
    lo, hi = np.minimum(src[keep], dst[keep]), np.maximum(src[keep], dst[keep])
    key = np.unique(lo * n_nodes + hi)  # each undirected pair once
    del keep, lo, hi
    # Both directions as row * n + col, sorted: the CSR's entries in order (rows, then columns within a row).
    # Built directly, not through scipy's COO -> CSR and sum_duplicates (the same matrix, bit for bit: no
    # duplicates are left to sum), which held about three times more copies of the edges at once
    # (a 10^6-session history: 35 M stored edges, 70 M entries).
    lo, hi = np.divmod(key, n_nodes)
    both = np.concatenate([key, hi * n_nodes + lo])
    del key, lo, hi
    both.sort()
    indptr = np.searchsorted(both, np.arange(n_nodes + 1, dtype=np.int64) * n_nodes)
    indices = both % n_nodes
    del both
    m = sp.csr_matrix((np.ones(indices.size), indices, indptr), shape=(n_nodes, n_nodes))
    # set after construction: the constructor would pick its own index dtype (int32 where the values fit)
    m.indices = indices.astype(index_dtype, copy=False)
    m.indptr = indptr.astype(index_dtype, copy=False)
    return m


def _to_backend_csr(adj: Any, xp: Any) -> Any:
    if xp is np:
        return sp.csr_matrix(adj) if not sp.isspmatrix_csr(adj) else adj
    import cupyx.scipy.sparse as csp  # noqa: PLC0415  (GPU only)

    if isinstance(adj, csp.csr_matrix):
        return adj
    h = sp.csr_matrix(adj)
    # cuSPARSE wants int32 indices
    return csp.csr_matrix(
        (xp.asarray(h.data), xp.asarray(h.indices.astype(np.int32)), xp.asarray(h.indptr.astype(np.int32))),
        shape=h.shape,
    )


def _column_sums(xp: Any, M: Any) -> Any:
    """Sums of the columns of ``M`` [N, Q], each summed alone (a row of the transposed copy, pairwise): the bits
    of a column's sum do not depend on Q or the other columns. NumPy's ``M.sum(axis=0)`` adds the rows one by
    one for Q > 1 and pairwise for Q = 1, so a question alone and in a batch summed differently."""
    return xp.ascontiguousarray(M.T).sum(axis=1)


def personalized_pagerank(
    adj: Any,
    reset: Any,
    damping: float,
    *,
    tol: float = 1e-12,
    max_iter: int = 10_000,
    device: str = "cpu",
) -> Any:
    """PPR for a batch of reset vectors.

    ``adj``: symmetric CSR [N, N] (e.g. from :func:`build_csr`; values are used as edge weights, 1 for
    an unweighted graph). ``reset``: [Q, N] non-negative. Returns float64 [Q, N] on ``device``, each row
    summing to 1 (or 0 for an all-zero reset row). Each query iterates until its own L1 change is < ``tol``
    (or ``max_iter``), and its row has the same bits in any batch (alone, with any other queries, in any
    order) on the host; checked by ``tests/kernels/test_ppr.py``.
    """
    if not 0.0 <= damping < 1.0:
        raise ValueError(f"damping must be in [0, 1), got {damping}")
    xp, dev = get_xp(device)
    R = to_device(reset, xp).astype(xp.float64)
    if R.ndim != 2 or R.shape[1] != adj.shape[0]:
        raise ValueError(f"reset must be [Q, {adj.shape[0]}], got {tuple(R.shape)}")
    if bool((R < 0).any()):
        raise ValueError("reset vectors must be non-negative")
    A = _to_backend_csr(adj, xp)
    tot = R.sum(axis=1, keepdims=True)
    zero = tot[:, 0] == 0
    U = (R / xp.where(tot == 0, 1.0, tot)).T.copy()  # [N, Q], columns sum to 1 (or 0)
    deg = xp.asarray(A.sum(axis=1)).ravel()
    dangling = deg == 0
    inv_deg = xp.where(dangling, 0.0, 1.0 / xp.where(dangling, 1.0, deg))[:, None]
    X = U
    if A.nnz == 0 or X.shape[1] == 0:
        return X.T.copy()
    # Loop invariants, computed once: the dangling rows as an index array (a boolean-mask gather makes CuPy
    # sync with the host every iteration to size its output; the same rows in the same order give the same
    # sums) and the restart term of graphs without dangling nodes. Arithmetic is unchanged, bit for bit.
    dang_idx = xp.nonzero(dangling)[0]
    has_dangling = int(dang_idx.size) > 0
    restart = None if has_dangling else (1.0 - damping) * U
    # Each question converges on its own: its column is frozen from the first iteration whose change *of that
    # column* is < tol, and every sum over nodes is a column's own (`_column_sums`), so a question's bits do not
    # depend on the other questions of its batch (the rank stage may then rank any number at a time). CPU: the
    # test is read every iteration; CUDA: every `check_every` iterations (frozen columns stay as they were, so
    # the result is that of reading it every iteration, with one host sync per block instead of two per step).
    check_every = max(1, int(CHECK_EVERY.get(dev, 1)))
    done = xp.zeros(X.shape[1], dtype=bool)
    change = xp.full(X.shape[1], xp.inf)
    # In place where it changes no value: a chunk of 16 questions at 10^6 sessions is 0.5 GB per [N, Q] array.
    for it in range(max_iter):
        X_new = A @ (X * inv_deg)
        X_new *= damping
        if has_dangling:
            X_new += (damping * _column_sums(xp, X[dang_idx])[None, :] + (1.0 - damping)) * U
        else:
            X_new += restart
        diff = X_new - X
        xp.abs(diff, out=diff)
        step = _column_sums(xp, diff)
        del diff
        if xp is not np:  # on the device without a host sync (a mask's size would need one)
            X = xp.where(done[None, :], X, X_new)
        else:
            if done.any():
                X_new[:, done] = X[:, done]  # frozen questions keep the value they converged to
            X = X_new
        change = xp.where(done, change, step)
        done = done | (step < tol)
        if ((it + 1) % check_every == 0 or it + 1 == max_iter) and bool(done.all()):
            break
    worst = float(change.max())
    if bool(done.all()):
        log.debug("PPR converged within %d iterations (largest last L1 change %.3g)", it + 1, worst)
    else:
        log.warning("PPR did not converge in %d iterations for %d of %d questions (largest last L1 change %.3g)",
                    max_iter, int((~done).sum()), X.shape[1], worst)
    s = _column_sums(xp, X)[None, :]
    X = X / xp.where(s == 0, 1.0, s)
    X = xp.where(zero[None, :], 0.0, X)
    return X.T.copy()
