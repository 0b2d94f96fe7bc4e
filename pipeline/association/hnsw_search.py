"""Approximate causal candidate search (faiss HNSW), kept on disk so appended sessions search it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from memgas.kernels.topk import topk
from memgas.pipeline.association.faiss_index import FaissCausalIndex
from memgas.pipeline.association.edges import Edges, _accept, _edges, concat_edges
from memgas.pipeline.association.nodes import (
    N_GRAN,
    Candidates,
    _as_nodes,
    _new_rows,
    _read_cols,
    _read_rows,
    _rescore,
    _scores64,
    MEM_THRESHOLD,
    MIN_PRIOR_NODES,
)


@dataclass(frozen=True)
class HNSWParams:
    """Approximate causal search (faiss HNSW). ``store``: how the index keeps vectors: "flat" (float32),
    "fp16" or "sq8" (faiss scalar quantisers: 1/2 and 1/4 of the memory; the chosen candidates are
    rescored from the float32 vectors either way, so only recall changes, never a reported score).
    ``fetch``: candidates asked of the index per row (0: ``mem_threshold`` for "flat", twice that for a
    quantised store, whose own scores may misorder near neighbours). ``threads``: faiss threads while
    adding; a graph built with more than one thread depends on timing (not reproducible byte for byte)."""

    m: int = 32
    ef_construction: int = 80
    ef_search: int = 128
    store: str = "fp16"
    fetch: int = 0
    block_sessions: int = 1024
    train_nodes: int = 1 << 16
    threads: int | None = 1


class CausalHNSW(FaissCausalIndex):
    """faiss HNSW index of one history's nodes, filled in node order so each row searches earlier nodes.

    Sessions are taken in blocks: a block's rows search the index, which then holds exactly the nodes of
    the sessions before the block; candidates in the block's own earlier sessions come from an exact
    block x block product; both lists are rescored exactly (float64 of the float32 vectors) and the best
    ``mem_threshold`` kept (ties by lower node id). The block's nodes are then added. The index can be
    saved and reloaded, so rows of appended sessions search it without rebuilding (:meth:`save`).
    """

    STORES = ("flat", "fp16", "sq8")

    def __init__(self, d: int, params: HNSWParams | None = None, *, index: Any = None) -> None:
        import faiss  # noqa: PLC0415

        self.params = p = params or HNSWParams()
        if p.store not in self.STORES:
            raise ValueError(f"HNSW store must be one of {self.STORES}, got {p.store!r}")
        if index is None:
            ip = faiss.METRIC_INNER_PRODUCT
            if p.store == "flat":
                index = faiss.IndexHNSWFlat(d, p.m, ip)
            else:
                qt = faiss.ScalarQuantizer.QT_fp16 if p.store == "fp16" else faiss.ScalarQuantizer.QT_8bit
                index = faiss.IndexHNSWSQ(d, qt, p.m, ip)
            index.hnsw.efConstruction = p.ef_construction
        index.hnsw.efSearch = p.ef_search
        self.index = index
        self.d = d

    @property
    def ntotal(self) -> int:
        """Nodes in the index (always whole sessions: the history's first ``ntotal`` nodes)."""
        return int(self.index.ntotal)


    def blocks(self, emb_nodes: Any, rows: np.ndarray, k: int) -> Any:
        """Search the ``rows`` (sorted node ids, all in sessions not yet indexed) block by block and add
        every node of ``emb_nodes`` past :attr:`ntotal`; yields ``(sel, cand, valid)`` per block of rows
        (``sel``: positions in ``rows``; candidates best first by exact score, -1 where invalid)."""
        E = _as_nodes(emb_nodes)
        n = E.shape[0]
        if E.shape[1] != self.d:
            raise ValueError(f"vectors of dimension {E.shape[1]} for an index of dimension {self.d}")
        if rows.size and int(rows[0]) < self.ntotal:
            raise ValueError(f"row {int(rows[0])} is already in the index (it holds {self.ntotal} nodes)")
        p = self.params
        fetch = p.fetch or (k if p.store == "flat" else 2 * k)
        row_sess = rows // N_GRAN
        with self._threads():
            if not self.index.is_trained:
                self.index.train(_read_cols(E, 0, min(n, p.train_nodes)))
            for a in range(self.ntotal // N_GRAN, n // N_GRAN, p.block_sessions):
                b = min(n // N_GRAN, a + p.block_sessions)
                lo_r, hi_r = np.searchsorted(row_sess, [a, b])
                blk = _read_cols(E, a * N_GRAN, b * N_GRAN)
                if hi_r > lo_r:
                    r = rows[lo_r:hi_r]
                    q = _read_rows(E, r)
                    parts = []
                    if self.ntotal:
                        _, i = self.index.search(q, min(fetch, self.ntotal))
                        parts.append(i.astype(np.int64))  # -1 where HNSW found fewer
                    # earlier sessions of this block: exact
                    s_in = q @ blk.T
                    lim = (row_sess[lo_r:hi_r] - a)[:, None] * N_GRAN
                    s_in = np.where(np.arange(blk.shape[0])[None, :] < lim, s_in, -np.inf).astype(np.float32)
                    ii, vv = topk(s_in, min(k, blk.shape[0]))
                    parts.append(np.where(np.isfinite(vv), ii + a * N_GRAN, -1))
                    alli = np.concatenate(parts, 1)
                    ok = alli >= 0
                    sc = np.where(ok, _scores64(E, r, np.where(ok, alli, 0)), -np.inf)
                    o = np.lexsort((np.where(ok, alli, np.iinfo(np.int64).max), -sc), axis=1)[:, :k]
                    ci = np.take_along_axis(alli, o, 1)
                    ok = np.take_along_axis(ok, o, 1)
                    cand = np.full((r.size, k), -1, np.int64)
                    valid = np.zeros((r.size, k), bool)
                    cand[:, : ci.shape[1]] = np.where(ok, ci, -1)
                    valid[:, : ci.shape[1]] = ok
                    yield np.arange(lo_r, hi_r), cand, valid
                self.index.add(blk)

    def candidates(self, emb_nodes: Any, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`blocks`, gathered: (cand [R, k], valid [R, k]) for all ``rows``."""
        cand = np.full((rows.size, k), -1, np.int64)
        valid = np.zeros((rows.size, k), bool)
        for sel, c, v in self.blocks(emb_nodes, rows, k):
            cand[sel], valid[sel] = c, v
        return cand, valid


def associate_hnsw(
    emb_nodes: Any, index: CausalHNSW | None = None, *, n_sessions_done: int = 0, mem_threshold: int = MEM_THRESHOLD,
    min_prior_nodes: int = MIN_PRIOR_NODES, hnsw: HNSWParams | None = None,
) -> tuple[Edges, CausalHNSW]:
    """Approximate association of the sessions >= ``n_sessions_done``, block by block (bounded memory:
    one block's candidates and GMM at a time; the edges are the only thing that grows).

    ``index``: a :class:`CausalHNSW` holding the first ``n_sessions_done`` sessions (from an earlier call,
    or :meth:`CausalHNSW.load`) so an append searches the new rows only; None builds one (adding, not
    searching, the sessions before ``n_sessions_done``). Returns the edges and the index, which then holds
    every node of ``emb_nodes``. GMM mode only (the MemGAS default).
    """
    E = _as_nodes(emb_nodes)
    k = int(mem_threshold)
    if index is None:
        index = CausalHNSW(E.shape[1], hnsw)
    rows = _new_rows(E.shape[0], index.ntotal, n_sessions_done, min_prior_nodes)
    out = []
    for sel, cand, valid in index.blocks(E, rows, k):
        c = Candidates(rows[sel], *_rescore(E, rows[sel], cand, valid))
        out.append(_edges(c, _accept([c], "gmm", None, "cpu")[0]))
    return concat_edges(out), index
