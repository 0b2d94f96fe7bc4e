"""Local Personalized PageRank by forward push (Andersen, Chung and Lang), the same quantity as ``ppr.py``.

Reference: R. Andersen, F. Chung, K. Lang, "Local graph partitioning using PageRank vectors", FOCS 2006.

Quantity: exactly the vector of :func:`memgas.kernels.ppr.personalized_pagerank` (python-igraph ``prpack``
semantics): ``damping`` = d = probability of following an edge, teleport probability 1 - d, the reset row
normalised to sum 1, dangling (degree-0) nodes sending their mass back through the reset vector, an
all-zero reset row giving an all-zero row, a graph without edges giving the normalised reset row.

Algorithm, per query (reset row r normalised to s): keep an estimate p (0) and a residual res (= s).
A *push* at node u moves (1 - d) * res[u] into p[u] and spreads d * res[u] over u's edges (weight
w_uv / deg(u) each, deg = weighted degree), then sets res[u] = 0. Nodes are pushed while
res[u] >= epsilon * deg(u). ACL push on the lazy walk; we push the plain (non-lazy) walk, so that p estimates the
exact kernel's vector and not the lazy one. Rounds push every node over the threshold at once (a push of any
residual amount keeps ACL's invariant p + sum_u res[u] * ppr_u = ppr_s, so a round is a valid sequence of
pushes), so each round is a few vectorised NumPy calls over the frontier's edges.

Dangling nodes: the exact kernel's rule (dangling mass re-enters through the reset vector) gives a vector
proportional to the one where that mass is simply dropped (both solve x = d A D^-1 x + c * s, for different
scalars c). So a push at a degree-0 node keeps (1 - d) * res[u] and drops the rest. In an undirected graph a
degree-0 node is isolated, so only seeds lose mass that way, exactly d * s(u) each: the estimate is divided by
the exact total 1 - d * (seed mass on degree-0 nodes). An isolated seed thus keeps its share and an isolated
non-seed gets 0, as there.

Guarantee: at the end every node has res[u] < epsilon * deg(u) (degree-0 nodes: res[u] = 0). With c the
exact total above (c = 1 without isolated seeds), the returned p / c satisfies, for every node v,
0 <= x(v) - p(v) / c < epsilon * deg(v) / c <= epsilon * deg(v) / (1 - d), x the exact kernel's vector
(ACL's bound, here for the non-lazy walk: y - p = sum_u res[u] * y_u, y_u the walk from u, and
y_u(v) / deg(v) = y_v(u) / deg(u) on an undirected graph). Total work is O(1 / (epsilon * (1 - d))) edge
visits per query, whatever the graph's size: only the seeds' neighbourhood is touched. Workspace arrays of N
floats are allocated once per call and only their touched entries are cleared between queries.

Determinism: each query is computed alone, in a fixed order (frontier in node order, ``np.add.at`` in edge
order), so the same inputs give the same bits whatever the batch.

No GPU path: push is a sequence of small, data-dependent, irregular scatter steps (frontiers of a few
hundred nodes), which a GPU runs no faster than a CPU; the GPU path is the exact kernel (sparse x dense power
iteration over the whole batch). Hand-written rather than a library: no well-kept Python package exposes a
forward push with igraph's dangling semantics and a per-degree residual threshold.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp


def _check(adj: Any, reset: np.ndarray, damping: float, epsilon: float) -> None:
    if not 0.0 <= damping < 1.0:
        raise ValueError(f"damping must be in [0, 1), got {damping}")
    if not epsilon > 0.0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")
    if reset.ndim != 2 or reset.shape[1] != adj.shape[0]:
        raise ValueError(f"reset must be [Q, {adj.shape[0]}], got {tuple(reset.shape)}")
    if bool((reset < 0).any()):
        raise ValueError("reset vectors must be non-negative")


def _unique_sorted(a: np.ndarray) -> np.ndarray:
    """Sorted distinct values of a small int array (np.unique hashes first: slower on frontier-sized arrays)."""
    s = np.sort(a)
    return s[np.concatenate(([True], s[1:] != s[:-1]))] if s.size else s


def push_one(indptr: np.ndarray, indices: np.ndarray, weights: np.ndarray, deg: np.ndarray,
             seeds: np.ndarray, seed_mass: np.ndarray, damping: float, epsilon: float,
             p: np.ndarray, res: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One query's push: (touched node ids ascending, their PPR values summing to 1).

    ``seeds`` ascending node ids with ``seed_mass`` > 0 summing to 1; ``p`` and ``res`` are all-zero
    workspaces of N float64, left all-zero on return. Cost follows the edges of the pushed nodes only. The
    values sum to at most 1 (short of it by the residual left, < epsilon * degree per node).
    """
    res[seeds] = seed_mass
    touched = [seeds]
    frontier = seeds[res[seeds] >= epsilon * deg[seeds]]
    while frontier.size:
        r = res[frontier]
        res[frontier] = 0.0
        p[frontier] += (1.0 - damping) * r
        live = deg[frontier] > 0  # a degree-0 node's walk mass is dropped (see the module docstring)
        f, r = frontier[live], r[live]
        if not f.size:
            break
        starts, counts = indptr[f], indptr[f + 1] - indptr[f]
        ends = np.cumsum(counts)
        pos = np.repeat(starts - ends + counts, counts) + np.arange(ends[-1])
        nbr = indices[pos]
        np.add.at(res, nbr, np.repeat(damping * r / deg[f], counts) * weights[pos])
        cand = _unique_sorted(nbr)
        touched.append(cand)
        frontier = cand[res[cand] >= epsilon * deg[cand]]
    nodes = _unique_sorted(np.concatenate(touched))
    vals = p[nodes]
    p[nodes] = 0.0
    res[nodes] = 0.0
    # the mass dropped at degree-0 seeds, known exactly (only seeds can be isolated and hold mass): rescale by
    # the exact total, not by the estimate's sum, so the error bound above holds after the rescaling too
    return nodes, vals / (1.0 - damping * seed_mass[deg[seeds] == 0].sum())


class PushGraph:
    """A graph prepared for push, once: int64 CSR arrays, edge weights and weighted degrees (what every call
    of :func:`personalized_pagerank_push` would otherwise derive again from the CSR, O(edges) each time)."""

    def __init__(self, adj: Any) -> None:
        A = adj if sp.isspmatrix_csr(adj) else sp.csr_matrix(adj)
        self.shape: tuple[int, int] = A.shape
        self.nnz = int(A.nnz)
        self.indptr, self.indices = A.indptr.astype(np.int64), A.indices.astype(np.int64)
        self.weights = np.asarray(A.data, dtype=np.float64)
        self.deg = np.asarray(A.sum(axis=1), dtype=np.float64).ravel()


def personalized_pagerank_push(adj: Any, reset: Any, damping: float, *, epsilon: float) -> np.ndarray:
    """PPR for a batch of reset vectors by forward push: float64 [Q, N] on the host.

    The contract of :func:`memgas.kernels.ppr.personalized_pagerank` (``adj`` symmetric CSR [N, N], values
    used as edge weights, or a :class:`PushGraph` of one; ``reset`` [Q, N] non-negative; an all-zero reset row
    gives an all-zero row), approximated from below with per-node residual < ``epsilon`` * degree (rows sum to 1
    only in the limit). CPU only (see the module docstring).
    """
    R = np.asarray(reset, dtype=np.float64)
    _check(adj, R, damping, epsilon)
    g = adj if isinstance(adj, PushGraph) else PushGraph(adj)
    n = g.shape[0]
    out = np.zeros(R.shape, dtype=np.float64)
    if g.nnz == 0:  # the exact kernel's answer for a graph without edges, to the bit: the normalised reset
        tot = R.sum(axis=1, keepdims=True)
        return R / np.where(tot == 0, 1.0, tot)
    p, res = np.zeros(n), np.zeros(n)
    for q in range(R.shape[0]):
        row = R[q]
        seeds = np.flatnonzero(row)
        if not seeds.size:
            continue  # all-zero reset row: all-zero answer, as the exact kernel
        mass = row[seeds] / row.sum()
        nodes, vals = push_one(g.indptr, g.indices, g.weights, g.deg, seeds, mass, damping, epsilon, p, res)
        out[q, nodes] = vals
    return out
