"""Approximate causal candidate search (faiss IVF), kept on disk so appended sessions search it.

A row's candidates are the best ``mem_threshold`` nodes of strictly earlier sessions among the nodes
whose inverted list is one of the row's ``nprobe`` nearest lists (centroids). That set does not depend on
how the history was cut into blocks: nodes already in the index come from the IVF search, earlier nodes
of the row's own block from an exact product restricted to the same lists, and both are rescored exactly
before the best are kept. So an append that searches a saved index gives the candidates of a fresh build
over the longer history (same training prefix), up to near-ties within the quantised store's rounding.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from memgas.pipeline.association.faiss_index import (
    FaissCausalIndex,
    empty_ivf_like,
    raw_bytes,
    raw_from_bytes,
    stacked_ivf,
)
from memgas.pipeline.association.edges import Edges, _accept, _edges, concat_edges
from memgas.pipeline.association.row_keys import bottom_k, row_keys
from memgas.pipeline.association.exact_search import _causal_candidates, _topk_rows, causal_rows
from memgas.pipeline.association.nodes import (
    _DEFAULTS,
    N_GRAN,
    Candidates,
    NodeFile,
    _as_nodes,
    _new_rows,
    _read_cols,
    _scores64,
    MEM_THRESHOLD,
    MIN_PRIOR_NODES,
    _first_row_session,
)

#: nodes per coarse-assignment tile; tiles sit on a grid of node ids so a node's float32 centroid
#: scores come from the same product shape wherever the block boundaries fall (BLAS low bits depend on it)
COARSE_TILE = 256
#: ids gathered per memory map when rescoring from a NodeFile (bounds the pages mapped at once)
GATHER_IDS = 8192
#: (row, node) pairs of a block scored at once by the in-block search (two [pairs, d] float32 gathers)
PAIR_CHUNK = 1 << 15


@dataclass(frozen=True)
class IVFParams:
    """Approximate causal search (faiss IVF, inner product, flat coarse quantizer).

    ``nlist``: inverted lists (k-means centroids, capped at ``train_nodes // 39`` when fewer nodes are
    there to train on); ``nprobe``: lists searched per row. ``store``: "flat" (float32), "fp16" or "sq8"
    (faiss scalar quantisers; candidates are rescored from the float32 vectors either way, so only recall
    changes). ``fetch``: candidates asked of the index and of the in-block product per row (0: 1.5 x
    ``mem_threshold``, a margin that keeps the exact best within reach of quantised scores).
    ``train_nodes``: the centroids are trained once, on the history's first ``train_nodes`` nodes
    (seeded k-means, ``seed``), and saved with the index. ``exact_nodes``: rows among the history's first
    ``exact_nodes`` nodes are searched exactly (their prefixes are short, and an early row may have few
    similar predecessors: its best candidates are then scattered over many lists). ``threads``: faiss
    threads while training, searching and adding (None: faiss's default).
    """

    # the job's defaults (pipeline/config.py, their one home): association.ivf_nlist, ivf_nprobe, ivf_exact_nodes
    nlist: int = _DEFAULTS.ivf_nlist
    nprobe: int = _DEFAULTS.ivf_nprobe
    store: str = "sq8"
    fetch: int = 0
    block_sessions: int = 1024
    train_nodes: int = _DEFAULTS.ivf_exact_nodes
    exact_nodes: int = _DEFAULTS.ivf_exact_nodes
    threads: int | None = None
    seed: int = 1234


class CausalIVF(FaissCausalIndex):
    """faiss IVF index of one history's nodes, filled in node order so each row searches earlier nodes.

    Sessions are taken in blocks: a block's rows search the index, which then holds exactly the nodes of
    the sessions before the block, in their ``nprobe`` nearest lists; candidates in the block's own
    earlier sessions come from an exact block x block product limited to the same lists; the union is
    rescored exactly (float64 of the float32 vectors) and the best ``mem_threshold`` kept (ties by lower
    node id). The block's nodes are then added. :meth:`save` / :meth:`load` keep the trained centroids
    with the lists, so rows of appended sessions search the index without rebuilding.
    """

    STORES = ("flat", "fp16", "sq8")

    def __init__(self, d: int, params: IVFParams | None = None, *, index: Any = None) -> None:
        self.params = p = params or IVFParams()
        if p.store not in self.STORES:
            raise ValueError(f"IVF store must be one of {self.STORES}, got {p.store!r}")
        self.d = d
        self.index = index  # built at the first training (its nlist depends on the training nodes)
        self._centroids: np.ndarray | None = None
        self.delta: Any = None  # the entries added since start_delta, when one was started
        self.rest: Any = None  # a stacked index's (:meth:`stacked`) own entries, after the mapped base's
        self._members: tuple = ()  # what a stacked index points into

    @classmethod
    def stacked(cls, base: Any, params: IVFParams | None = None) -> CausalIVF:
        """The index ``base`` (a mapped file, :func:`~memgas.pipeline.association.faiss_index.raw_from_file`)
        searched as it is, with the entries added later (:meth:`merge_delta`, the walk's blocks) kept apart in
        memory and searched after base's in each list (:func:`stacked_ivf`): the same results, bit for bit, as
        ``base`` loaded and those entries added to it, without reading ``base`` whole."""
        shell, members = stacked_ivf(base, empty_ivf_like(base))
        out = cls(base.d, params, index=shell)
        out.rest, out._members = members[1], members
        return out

    @property
    def ntotal(self) -> int:
        """Nodes in the index (always whole sessions: the history's first ``ntotal`` nodes)."""
        return 0 if self.index is None else int(self.index.ntotal)

    @property
    def nlist(self) -> int:
        return 0 if self.index is None else int(self.index.nlist)


    def train(self, emb_nodes: Any) -> None:
        """Train the centroids (and the scalar quantiser) on the first ``train_nodes`` nodes."""
        import faiss

        p = self.params
        E = _as_nodes(emb_nodes)
        x = _read_cols(E, 0, min(E.shape[0], p.train_nodes))
        nlist = max(1, min(p.nlist, x.shape[0] // 39))  # faiss wants >= 39 training points per centroid
        quantizer = faiss.IndexFlatIP(self.d)
        ip = faiss.METRIC_INNER_PRODUCT
        if p.store == "flat":
            index = faiss.IndexIVFFlat(quantizer, self.d, nlist, ip)
        else:
            qt = faiss.ScalarQuantizer.QT_fp16 if p.store == "fp16" else faiss.ScalarQuantizer.QT_8bit
            index = faiss.IndexIVFScalarQuantizer(quantizer, self.d, nlist, qt, ip, False)
        index.cp.seed = p.seed
        index.cp.spherical = True  # unit vectors searched by inner product: unit centroids
        index.train(x)
        index.own_fields = True
        quantizer.this.disown()
        self.index = index
        self._centroids = None

    def centroids(self) -> np.ndarray:
        """float32 [nlist, d] centroids of the trained index."""
        if self._centroids is None:
            q = self.index.quantizer
            self._centroids = q.reconstruct_n(0, q.ntotal).astype(np.float32)
        return self._centroids

    def coarse(self, E: Any, c0: int, c1: int, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ``nprobe`` nearest lists of nodes ``[c0, c1)`` (rows of ``block``), best first, ties by
        lower list id, and their float32 centroid scores. Products run on whole :data:`COARSE_TILE` tiles
        of the node-id grid (zero rows outside ``[c0, c1)``) so a node's lists never depend on the block."""
        cen = self.centroids()
        npr = min(self.params.nprobe, cen.shape[0])
        lists = np.empty((c1 - c0, npr), np.int64)
        dis = np.empty((c1 - c0, npr), np.float32)
        t = COARSE_TILE
        for a in range(c0 // t * t, c1, t):
            lo, hi = max(a, c0), min(a + t, c1)
            tile = np.zeros((t, self.d), np.float32)
            tile[lo - a : hi - a] = block[lo - c0 : hi - c0]
            ii, vv = _topk_rows(tile @ cen.T, npr)
            lists[lo - c0 : hi - c0] = ii[lo - a : hi - a]
            dis[lo - c0 : hi - c0] = vv[lo - a : hi - a]
        return lists, dis

    def blocks(self, emb_nodes: Any, rows: np.ndarray, k: int) -> Iterator[tuple[np.ndarray, Candidates]]:
        """Search the ``rows`` (sorted node ids, all in sessions not yet indexed) block by block and add
        every node of ``emb_nodes`` past :attr:`ntotal`; yields ``(sel, candidates)`` per block of rows
        (``sel``: positions in ``rows``; candidates best first by their exact float64 scores)."""
        E = _as_nodes(emb_nodes)
        n = E.shape[0]
        if E.shape[1] != self.d:
            raise ValueError(f"vectors of dimension {E.shape[1]} for an index of dimension {self.d}")
        if rows.size and int(rows[0]) < self.ntotal:
            raise ValueError(f"row {int(rows[0])} is already in the index (it holds {self.ntotal} nodes)")
        p = self.params
        fetch = p.fetch or k + k // 2
        row_sess = rows // N_GRAN
        with self._threads():
            if self.index is None:
                self.train(E)
            self.index.nprobe = min(p.nprobe, self.nlist)
            for a in range(self.ntotal // N_GRAN, n // N_GRAN, p.block_sessions):
                b = min(n // N_GRAN, a + p.block_sessions)
                lo_r, hi_r = np.searchsorted(row_sess, [a, b])
                blk = _read_cols(E, a * N_GRAN, b * N_GRAN)
                lists, dis = self.coarse(E, a * N_GRAN, b * N_GRAN, blk)
                cut = int(np.searchsorted(rows, p.exact_nodes, side="left").clip(lo_r, hi_r))
                if cut > lo_r:
                    sel = np.arange(lo_r, cut)
                    exact = _causal_candidates(E, rows[sel], k, "cpu")[0]
                    yield sel, _select(E, rows[sel], exact, blk, a * N_GRAN, k)
                if hi_r > cut:
                    sel = np.arange(cut, hi_r)
                    yield sel, self._block_candidates(E, rows[sel], a, blk, lists, dis, k, fetch)
                self._add(blk, lists[:, 0])

    def candidates(self, emb_nodes: Any, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`blocks`, gathered: (cand [R, k], valid [R, k]) for all ``rows``."""
        cand = np.full((rows.size, k), -1, np.int64)
        valid = np.zeros((rows.size, k), bool)
        for sel, c in self.blocks(emb_nodes, rows, k):
            cand[sel], valid[sel] = c.cand, c.valid
        return cand, valid

    def _add(self, blk: np.ndarray, assign: np.ndarray) -> None:
        from faiss.contrib.ivf_tools import add_preassigned

        assign = np.ascontiguousarray(assign, dtype=np.int64)
        # the entries' node ids, for the delta and a stacked index's in-memory part (their own ids would start
        # at 0). ``ids`` is kept referenced here: add_preassigned rebinds its argument to a raw pointer, so an
        # array made in the call would be freed before faiss reads it (faiss copies the ids it stores)
        ids = np.arange(self.ntotal, self.ntotal + blk.shape[0], dtype=np.int64)
        if self.delta is not None:
            add_preassigned(self.delta, blk, assign, ids=ids)
        if self.rest is not None:  # a stacked index: its base is read-only, the entries go after it
            add_preassigned(self.rest, blk, assign, ids=ids)
            self.index.ntotal += blk.shape[0]
        else:
            add_preassigned(self.index, blk, assign)

    def start_delta(self) -> None:
        """From now on, also keep the entries added in a *delta*: an index of the same trained centroids and
        quantiser holding only them (:func:`delta_bytes`). Merged into the index it was started on
        (:meth:`merge_delta`), it gives the index that added them, byte for byte: each list gets the same
        entries appended in the same order (the tests compare the serialised bytes)."""
        self.delta = empty_ivf_like(self.index)

    def merge_delta(self, delta: Any) -> None:
        """Append a stored delta's entries (:func:`raw_from_bytes`) to this index's lists, in order."""
        if delta.nlist != self.index.nlist or delta.code_size != self.index.code_size:
            raise ValueError(f"an IVF delta of {delta.nlist} lists does not fit an index of {self.index.nlist}")
        if self.rest is not None:  # a stacked index: after the base's entries, in the same order
            n = int(delta.ntotal)  # merge_from empties the delta
            self.rest.merge_from(delta, 0)
            self.index.ntotal += n
        else:
            self.index.merge_from(delta, 0)  # ids are the delta's own: node ids
        self._centroids = None

    def _block_candidates(self, E: Any, r: np.ndarray, a: int, blk: np.ndarray, lists: np.ndarray,
                          dis: np.ndarray, k: int, fetch: int) -> Candidates:
        """Candidates of the rows ``r`` of the block starting at session ``a`` (see :meth:`blocks`)."""
        return _select(E, r, self._block_found(r, a, blk, lists, dis, fetch), blk, a * N_GRAN, k)

    def _block_found(self, r: np.ndarray, a: int, blk: np.ndarray, lists: np.ndarray, dis: np.ndarray,
                     fetch: int) -> np.ndarray:
        """Node ids (-1: none) the rows ``r`` of the block starting at session ``a`` found, before the exact
        rescoring: the index's best ``fetch`` in the probed lists, then the block's own (:meth:`_in_block`)."""
        c0 = a * N_GRAN
        pos = r - c0
        q = blk[pos]
        parts = []
        if self.ntotal:
            _, i = self.index.search_preassigned(q, min(fetch, self.ntotal), lists[pos], dis[pos])
            parts.append(i.astype(np.int64))  # -1 where the probed lists hold fewer
        inb = self._in_block(q, pos, blk, lists, fetch)
        parts.append(np.where(inb >= 0, inb + c0, -1))
        return np.concatenate(parts, 1)

    def _in_block(self, q: np.ndarray, pos: np.ndarray, blk: np.ndarray, lists: np.ndarray,
                  fetch: int, lim: np.ndarray | None = None) -> np.ndarray:
        """Best ``fetch`` block columns per row (float32 scores): earlier sessions of the block whose list
        is one of the row's probed lists; positions in the block, -1 where there are fewer. ``lim``: per row,
        where its session starts in the block (default: four nodes a session; memgas-cards' graph gives its own).

        Sparse: only the (row, node) pairs sharing a probed list are scored (a few per row), not the
        block x block product."""
        assign = lists[:, 0]
        order = np.argsort(assign, kind="stable")
        starts = np.searchsorted(assign[order], np.arange(self.nlist + 1))
        probes = lists[pos]  # [R, nprobe]
        cnt = (starts[probes + 1] - starts[probes]).ravel()
        pr = np.repeat(np.arange(probes.size), cnt)  # one entry per (row, probe, node of that list)
        off = np.arange(pr.size) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        col = order[starts[probes.ravel()[pr]] + off]
        row = pr // probes.shape[1]
        keep = col < (pos[row] // N_GRAN * N_GRAN if lim is None else lim[row])  # earlier sessions of the block only
        row, col = row[keep], col[keep]
        # a pair's score is its own dot product: scored PAIR_CHUNK pairs at a time (the same bits), so that
        # the gathered vectors stay small where few lists hold many of a block's nodes (millions of pairs)
        sc = np.concatenate([np.einsum("pd,pd->p", q[row[i : i + PAIR_CHUNK]], blk[col[i : i + PAIR_CHUNK]])
                             for i in range(0, row.size, PAIR_CHUNK)]) if row.size else np.zeros(0, np.float32)
        o = np.lexsort((col, -sc, row))  # by row, best first, ties by lower node
        row, col = row[o], col[o]
        rank = np.arange(row.size) - np.searchsorted(row, row)
        out = np.full((pos.size, min(fetch, int(rank.max(initial=-1)) + 1)), -1, np.int64)
        m = rank < fetch
        out[row[m], rank[m]] = col[m]
        return out


def _select(E: Any, r: np.ndarray, alli: np.ndarray, blk: np.ndarray, c0: int, k: int) -> Candidates:
    """Best ``k`` of the ids ``alli`` (-1: none) per row by exact score, ties by lower id, rescored.

    The vectors are gathered once per block (sorted ids: the block's own rows come from ``blk``) into a
    compact matrix whose row order follows the node ids, so ``_scores64`` on it gives the scores and tie
    order it gives on the whole history; an entry's score does not depend on the other entries of its
    row, so the kept scores are those ``_rescore`` gives (the tests check it).
    """
    ok = alli >= 0
    ids = np.unique(alli[ok & (alli < c0)])
    C = np.concatenate([_gather(E, ids), blk])
    loc = np.where(alli >= c0, ids.size + alli - c0, np.searchsorted(ids, alli))
    loc = np.where(ok, loc, 0)
    r_loc = ids.size + r - c0
    sc = np.where(ok, _scores64(C, r_loc, loc), -np.inf)
    o = np.lexsort((np.where(ok, loc, np.iinfo(np.int64).max), -sc), axis=1)[:, :k]
    ci = np.take_along_axis(loc, o, 1)
    ok = np.take_along_axis(ok, o, 1)
    cs = np.take_along_axis(sc, o, 1)
    cand = np.full((r.size, k), -1, np.int64)
    valid = np.zeros((r.size, k), bool)
    scores = np.zeros((r.size, k))
    cand[:, : ci.shape[1]] = np.where(ok, ci, -1)
    valid[:, : ci.shape[1]] = ok
    scores[:, : ci.shape[1]] = np.where(ok, cs, 0.0)
    glob = cand - ids.size + c0  # block columns
    prior = valid & (cand < ids.size)
    glob[prior] = ids[cand[prior]]
    return Candidates(r, np.where(valid, glob, -1), valid, scores)


def _gather(E: Any, ids: np.ndarray) -> np.ndarray:
    """float32 rows ``E[ids]`` (sorted unique ids). From a :class:`NodeFile`, through a read-only memory
    map opened per :data:`GATHER_IDS` ids and dropped at once: one ``pread`` per scattered id costs a
    syscall each, while the map's pages (which count in RSS while mapped) stay bounded by the batch."""
    if not isinstance(E, NodeFile):
        return np.ascontiguousarray(E[ids], dtype=np.float32)
    out = np.empty((ids.size, E.shape[1]), np.float32)
    for a in range(0, ids.size, GATHER_IDS):
        mm = np.memmap(E.path, np.float32, "r", E.offset, E.shape)
        out[a : a + GATHER_IDS] = mm[ids[a : a + GATHER_IDS]]
        del mm
    return out


def associate_ivf(
    emb_nodes: Any, index: CausalIVF | None = None, *, n_sessions_done: int = 0, mem_threshold: int = MEM_THRESHOLD,
    min_prior_nodes: int = MIN_PRIOR_NODES, ivf: IVFParams | None = None,
) -> tuple[Edges, CausalIVF]:
    """:func:`associate_hnsw` with the IVF search: the edges of the sessions >= ``n_sessions_done`` (an
    ``index`` holding exactly the sessions before them, or None to build one) and the index, which then
    holds every node. GMM mode only."""
    E = _as_nodes(emb_nodes)
    k = int(mem_threshold)
    if index is None:
        index = CausalIVF(E.shape[1], ivf)
    rows = _new_rows(E.shape[0], index.ntotal, n_sessions_done, min_prior_nodes)
    out = [_edges(c, _accept([c], "gmm", None, "cpu")[0]) for _, c in index.blocks(E, rows, k)]
    return concat_edges(out), index


# -- the associate stage's IVF rows: a saved index on a fixed grid of session blocks ----------------------
#: rows sampled per history for the candidate recall against the exact search (all when fewer): the rows
#: past the exact prefix with the smallest :func:`row_keys` (the driver ships it to the tasks)
RECALL_ROWS = 256
#: sessions per block of the stage's IVF grid (IVFParams' default; the tests make it small)
STAGE_BLOCK_SESSIONS = IVFParams.block_sessions


def index_sessions(end_session: int, grid: int | None = None) -> int:
    """Sessions the stage's saved index holds once the rows of sessions before ``end_session`` are done:
    the complete grid blocks (:func:`ivf_rows`) of ``grid`` sessions (None: :data:`STAGE_BLOCK_SESSIONS`)."""
    g = grid or STAGE_BLOCK_SESSIONS
    return end_session // g * g


def stage_params(nlist: int, nprobe: int, exact_nodes: int, block_sessions: int | None = None) -> IVFParams:
    """The associate stage's IVF: centroids trained on the exact prefix (so a history is trained once, on
    nodes that never change while it grows), one faiss thread (the job runs one task per core, and k-means
    and the searches then give the same bits on any machine's thread count: so every unit of one history
    that trains its own centroids gets the same ones). ``block_sessions``: the grid (None:
    :data:`STAGE_BLOCK_SESSIONS`; the driver ships its value to the tasks, which may run in other processes)."""
    return IVFParams(nlist=nlist, nprobe=nprobe, train_nodes=exact_nodes, exact_nodes=exact_nodes, threads=1,
                     block_sessions=block_sessions or STAGE_BLOCK_SESSIONS)


def index_bytes(index: CausalIVF) -> np.ndarray:
    """The index's faiss index as bytes (:func:`raw_bytes`; a stacked index is never saved whole)."""
    if index.rest is not None:
        raise ValueError("a stacked IVF index (a mapped base) is saved as its delta, never whole")
    return raw_bytes(index.index)


def delta_bytes(index: CausalIVF) -> np.ndarray:
    """The entries added since :meth:`CausalIVF.start_delta`, as an index of their own (:func:`raw_bytes`)."""
    return raw_bytes(index.delta)


def index_from_bytes(data: Any, params: IVFParams, *, d: int, ntotal: int) -> CausalIVF:
    """An index stored by :func:`index_bytes` (:func:`raw_from_bytes`)."""
    return CausalIVF(d, params, index=raw_from_bytes(data, d=d, ntotal=ntotal))


def ivf_rows(emb_nodes: Any, a: int, b: int, index: CausalIVF | None, *, mem_threshold: int = MEM_THRESHOLD,
             min_prior_nodes: int = MIN_PRIOR_NODES, params: IVFParams,
             found: dict[int, np.ndarray] | None = None) -> tuple[Candidates, CausalIVF | None]:
    """Candidates of the rows (node ids) ``[a, b)`` of one history under the stage's IVF search.

    Rows below ``params.exact_nodes`` are the exact search's (:func:`causal_rows`, byte for byte). Above,
    the index (``index``: the history's saved index, or None to train one on the exact prefix) is walked
    over a fixed grid of ``params.block_sessions`` session blocks from session 0: a row searches the index
    of the blocks before its own plus its own block's earlier sessions (exact product, same lists), and only
    *complete* grid blocks are added. So the index that comes back (to be saved) holds the sessions before
    the last complete block, and the rows of appended sessions see the same index and the same in-block
    nodes as a fresh build over the longer history: the same candidates, byte for byte, quantised store or
    not. ``emb_nodes`` holds the nodes ``[0, b)`` (whole sessions). ``found``: what :func:`ivf_found` found
    for these rows over the same index (per grid block), used instead of searching again: then
    ``emb_nodes`` need hold only the blocks from the index's end and the rows found before it. Returns the
    candidates and the index (None when no row needed one)."""
    E = _as_nodes(emb_nodes)
    if b != E.shape[0]:
        raise ValueError(f"ivf_rows needs exactly the nodes [0, {b}), got {E.shape[0]}")
    p, k = params, int(mem_threshold)
    cut = max(a, min(b, p.exact_nodes))
    parts = [causal_rows(E, a, cut, mem_threshold=k, min_prior_nodes=min_prior_nodes)]
    rows = index_rows(a, b, p, min_prior_nodes)
    if rows.size and found is not None:  # no index needed: the rows found, rescored
        parts.append(_found_rows(E, rows, k, found, p.block_sessions))
    elif rows.size:
        index = index if index is not None else CausalIVF(E.shape[1], p)
        parts.append(_grid_rows(index, E, rows, k))
    return _concat(parts, k), index


def index_rows(a: int, b: int, p: IVFParams, min_prior_nodes: int) -> np.ndarray:
    """The rows of ``[a, b)`` that :func:`ivf_rows` searches with the index (past the exact prefix)."""
    cut = max(a, min(b, p.exact_nodes))
    return np.arange(max(cut, N_GRAN * _first_session(min_prior_nodes)), b, dtype=np.int64)


def ivf_found(emb_nodes: Any, a: int, b: int, index: CausalIVF, *, mem_threshold: int = MEM_THRESHOLD,
              min_prior_nodes: int = MIN_PRIOR_NODES, params: IVFParams) -> dict[int, np.ndarray]:
    """What :func:`ivf_rows` finds for the rows ``[a, b)`` (all past the exact prefix) over ``index`` (a saved
    index, which this walk fills as ivf_rows does: pass a copy), per grid block (its first session): the
    node ids before the exact rescoring. With them, ivf_rows reads only the nodes from the index's end
    (``emb_nodes`` here needs no others) and those found before it (:func:`found_before`): a driver reads
    every stored block, but ships a task only these rows, not the history's matrix."""
    E = _as_nodes(emb_nodes)
    p, k = params, int(mem_threshold)
    if a < p.exact_nodes:
        raise ValueError(f"ivf_found: rows from {a} include the exact prefix (< {p.exact_nodes})")
    rows = index_rows(a, b, p, min_prior_nodes)
    fetch = p.fetch or k + k // 2
    return {s0: index._block_found(rows[lo:hi], s0, blk, lists, dis, fetch)
            for s0, lo, hi, blk, lists, dis in _grid_walk(index, E, rows) if hi > lo}


def found_before(found: dict[int, np.ndarray], end: int) -> np.ndarray:
    """The sorted node ids below ``end`` (the index's end, in nodes) among ``found``: the rows a task that is
    given ``found`` reads before the index's end (``_select`` gathers them to rescore)."""
    ids = [f[(f >= 0) & (f < end)] for f in found.values()]
    return np.unique(np.concatenate(ids)) if ids else np.zeros(0, np.int64)


def _first_session(min_prior_nodes: int) -> int:
    return _first_row_session(0, min_prior_nodes)


def _grid_walk(ivf: CausalIVF, E: Any, rows: np.ndarray) -> Iterator[tuple[int, int, int, np.ndarray, np.ndarray,
                                                                              np.ndarray]]:
    """The index's grid blocks from its end to the last session: ``(first session, rows[lo:hi] in it, its
    nodes, their probed lists and centroid scores)``; a complete block is added to ``ivf`` once the caller
    is done with it (a partial block stays out: the next append sees it as a fresh build does)."""
    p, n_sess = ivf.params, E.shape[0] // N_GRAN
    bs = p.block_sessions
    if ivf.ntotal % (N_GRAN * bs) or int(rows[0]) // N_GRAN < ivf.ntotal // N_GRAN:
        raise ValueError(f"the saved IVF index holds {ivf.ntotal} nodes: not a whole number of "
                         f"{bs}-session blocks before row {int(rows[0])}")
    row_sess = rows // N_GRAN
    with ivf._threads():
        if ivf.index is None:
            ivf.train(E)
        ivf.index.nprobe = min(p.nprobe, ivf.nlist)
        for s0 in range(ivf.ntotal // N_GRAN, n_sess, bs):
            s1 = min(n_sess, s0 + bs)
            lo, hi = np.searchsorted(row_sess, [s0, s1])
            blk = _read_cols(E, s0 * N_GRAN, s1 * N_GRAN)
            lists, dis = ivf.coarse(E, s0 * N_GRAN, s1 * N_GRAN, blk)
            yield s0, int(lo), int(hi), blk, lists, dis
            if s1 - s0 == bs:
                ivf._add(blk, lists[:, 0])


def _grid_rows(ivf: CausalIVF, E: Any, rows: np.ndarray, k: int) -> Candidates:
    """IVF candidates of ``rows`` (all past the exact prefix), adding complete grid blocks to ``ivf``."""
    fetch = ivf.params.fetch or k + k // 2
    return _concat([_select(E, rows[lo:hi], ivf._block_found(rows[lo:hi], s0, blk, lists, dis, fetch), blk,
                            s0 * N_GRAN, k)
                    for s0, lo, hi, blk, lists, dis in _grid_walk(ivf, E, rows) if hi > lo], k)


def _found_rows(E: Any, rows: np.ndarray, k: int, found: dict[int, np.ndarray], block_sessions: int) -> Candidates:
    """:func:`_grid_rows` given what each grid block's rows found (:func:`ivf_found`): the same rescoring
    (``_select``), no index. ``found`` must hold every block of ``rows``, each with its rows."""
    row_sess, n_sess, out, seen = rows // N_GRAN, E.shape[0] // N_GRAN, [], 0
    for s0 in sorted(found):
        s1 = min(n_sess, s0 + block_sessions)
        lo, hi = (int(x) for x in np.searchsorted(row_sess, [s0, s1]))
        if s0 % block_sessions or found[s0].shape[0] != hi - lo or hi == lo:
            raise ValueError(f"the IVF ids found for the block at session {s0} are not those of its rows")
        out.append(_select(E, rows[lo:hi], found[s0], _read_cols(E, s0 * N_GRAN, s1 * N_GRAN), s0 * N_GRAN, k))
        seen += hi - lo
    if seen != rows.size:
        raise ValueError(f"the IVF ids found hold {seen} of the {rows.size} rows asked for")
    return _concat(out, k)


def _concat(parts: list[Candidates], k: int) -> Candidates:
    parts = [c for c in parts if c.rows.size]
    if not parts:
        return Candidates(np.zeros(0, np.int64), np.full((0, k), -1, np.int64), np.zeros((0, k), bool),
                          np.zeros((0, k)))
    return Candidates(*(np.concatenate([getattr(c, f) for c in parts]) for f in ("rows", "cand", "valid", "scores")))


def recall_sample(history_id: str, rows: np.ndarray, k: int = RECALL_ROWS,
                  first_row: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The rows (sorted) of one unit whose candidates are compared with the exact search's, and their keys:
    the ``k`` of ``rows`` (the unit's rows past the exact prefix) with the smallest :func:`row_keys`.

    A history's sample is the ``k`` smallest keys among *all* its rows past the exact prefix. Each of those
    is among the ``k`` smallest of its own unit's rows (fewer than ``k`` of the unit's rows are smaller),
    so the units' samples together hold it, whatever the cut: :func:`history_sample` keeps it at report
    time, and the measured recall is that of one fresh build (after an append too).

    ``first_row``: the history's first row past the exact prefix (:func:`first_ivf_row`). The rows
    ``[first_row, rows[0])`` are earlier units' (their keys follow from the node ids alone), and a row whose
    key is not below the ``k``-th smallest of theirs cannot be in the history's sample (``k`` earlier rows
    are smaller): it is left out. An append of 1,000 sessions to 10^5 then checks ~3 rows against the exact
    search instead of 256 (each check a product over the whole prefix); the union keeps the history's sample."""
    rows = np.asarray(rows, np.int64)
    keys = row_keys(history_id, rows)
    pick = np.sort(bottom_k(keys, k))  # rows are sorted: positions in order are rows in order
    rows, keys = rows[pick], keys[pick]
    if first_row is not None and rows.size and int(rows[0]) - first_row >= k > 0:
        earlier = row_keys(history_id, np.arange(first_row, int(rows[0]), dtype=np.int64))
        below = np.partition(earlier, k - 1)[k - 1]
        keep = keys < below
        rows, keys = rows[keep], keys[keep]
    return rows, keys


def first_ivf_row(exact_nodes: int, min_prior_nodes: int) -> int:
    """A history's first row that :func:`ivf_rows` searches with the index (the rows before it are exact)."""
    return max(int(exact_nodes), N_GRAN * _first_session(min_prior_nodes))


def history_sample(history_ids: np.ndarray, keys: np.ndarray, k: int = RECALL_ROWS) -> np.ndarray:
    """Positions of the rows in a history's sample: per history (``history_ids[i]`` of the stored row
    ``i``), its ``k`` smallest ``keys`` among the rows the units stored (:func:`recall_sample`)."""
    if not len(keys):
        return np.zeros(0, np.int64)
    _, code = np.unique(np.asarray(history_ids, dtype=object), return_inverse=True)
    order = np.lexsort((np.asarray(keys, np.uint64), code))  # by history, then key
    c = code[order]
    rank = np.arange(c.size) - np.searchsorted(c, c)  # place within its history
    return np.sort(order[rank < k])


def sample_exact(E: Any, sample: np.ndarray, k: int, before: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The exact search's ``(cand, valid)`` of the ``sample`` rows (:func:`_causal_candidates` on the CPU), what
    :func:`candidate_hits` compares a sample's IVF candidates with."""
    return _causal_candidates(E, sample, k, "cpu", before=before)


def candidate_hits(E: Any, got: Candidates, sample: np.ndarray, k: int, before: np.ndarray | None = None,
                   exact: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per ``sample`` row (sorted node ids among ``got.rows``): (hits, total), of the exact search's valid
    candidates (``total``) how many ``got`` holds too. A row's exact candidates do not depend on the other
    rows asked for (canonical shapes), so its counts are the same in any unit. ``before``: the sample rows'
    prefixes (:func:`_causal_candidates`; default: four nodes a session). ``exact``: the sample's exact
    ``(cand, valid)`` computed already (an append's driver, which reads every row; ``E`` is then not read)."""
    hits = np.zeros(sample.size, np.int64)
    total = np.zeros(sample.size, np.int64)
    if not sample.size:
        return hits, total
    exact, valid = exact if exact is not None else sample_exact(E, sample, k, before)
    pos = np.searchsorted(got.rows, sample)
    for i, j in enumerate(pos):
        want = set(exact[i][valid[i]].tolist())
        hits[i] = len(want & set(got.cand[j][got.valid[j]].tolist()))
        total[i] = len(want)
    return hits, total


def candidate_recall(E: Any, got: Candidates, sample: np.ndarray, k: int) -> tuple[int, int]:
    """(hits, total) of :func:`candidate_hits` summed: recall@k = hits / total."""
    hits, total = candidate_hits(E, got, sample, k)
    return int(hits.sum()), int(total.sum())
