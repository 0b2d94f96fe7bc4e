"""memgas-cards' candidate search past an exact prefix: MemGAS's IVF search over the card graph.

Under ``association.search: ivf`` the rows among the graph's first ``exact_nodes`` nodes are searched exactly
(:func:`memgas.pipeline.card_graph.card_graph_candidates`), and the rows after them with MemGAS's
:class:`~memgas.pipeline.association.ivf_search.CausalIVF`: centroids trained on the first ``train_nodes``
nodes (the exact prefix: nodes an append never changes), a fixed grid of ``block_sessions`` session blocks
from session 0, each complete block added to the index once its rows are searched; a row takes the index's
best ``fetch`` in its ``nprobe`` lists (nodes of the blocks before its own) and its own block's earlier sessions
in the same lists, all rescored exactly (float64) and the best ``mem_threshold`` kept. The grid is fixed by
session ids and a session's nodes by the prefix, so a segment's rows get the candidates a fresh build over the
whole history gives them: append equals fresh. Sessions hold any number of nodes here, so a block's node range
and a row's earlier sessions come from the graph's ``starts`` (MemGAS's walk assumes four a session).

A call may start from a saved index (``index``: the centroids and the complete grid blocks of sessions
``[0, s)``, ``s`` a multiple of ``block_sessions``, as an earlier walk left it): the walk then continues at
session ``s``, exactly where a fresh one would be there, and neither trains nor revisits a block before it.
Without one it trains its own (the same bits each time: seeded k-means on one faiss thread, as the associate
stage's ``stage_params``). Either way it walks to the graph's last session, so the index it leaves holds the
complete blocks of the whole graph: what the card-graph-associate stage saves.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from memgas.pipeline.association.ivf_search import CausalIVF, IVFParams, _concat, _select, candidate_hits
from memgas.pipeline.association.nodes import Candidates, ReadInBlocks, _read_cols
from memgas.pipeline.card_graph import CardGraph, _eligible, card_graph_candidates


class _Prefix(ReadInBlocks):
    """The first ``n`` rows of a node matrix, read as it is (the IVF's training reads its rows once): a card
    graph's node count is not four a session, which a plain array would have to be."""

    def __init__(self, E: Any, n: int) -> None:
        self.E, self.shape, self.dtype = E, (int(n), int(E.shape[1])), np.dtype(np.float32)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, slice):
            a, b, _ = key.indices(self.shape[0])
            return np.asarray(self.E[a:b], np.float32)
        return np.asarray(self.E[key], np.float32)


def card_graph_ivf_candidates(g: CardGraph, *, mem_threshold: int, min_prior_nodes: int, params: IVFParams,
                              sessions: tuple[int, int] | None = None, index: CausalIVF | None = None) -> Candidates:
    """Each eligible node's candidates (as :func:`card_graph_candidates`), exact below ``params.exact_nodes`` and
    by the IVF search above (module docstring); ``sessions=(a, b)``: the rows of sessions ``[a, b)`` only.
    ``index``: the walk's index, filled in place (untrained: trained here; a saved one: continued from its
    end, which must be at or before the rows' first session); None: one of its own."""
    k = int(mem_threshold)
    # the exact search of the prefix's rows only: the rows after it are the index's (searching them exactly
    # too would cost a huge history's exact search, which this path exists to avoid)
    parts = [card_graph_candidates(g, mem_threshold=k, min_prior_nodes=min_prior_nodes, sessions=sessions,
                                   below=params.exact_nodes)]
    rows = ivf_rows(g, min_prior_nodes, params, sessions)
    if rows.size:
        parts.append(_walk(g, rows, k, params, index))
    return _concat(parts, k)


def ivf_rows(g: CardGraph, min_prior_nodes: int, params: IVFParams,
             sessions: tuple[int, int] | None = None) -> np.ndarray:
    """The rows (sorted node ids) that :func:`card_graph_ivf_candidates` searches with the index."""
    rows, _ = _eligible(g, min_prior_nodes)
    rows = rows[rows >= params.exact_nodes]
    if sessions is not None:
        s = g.session[rows]
        rows = rows[(s >= sessions[0]) & (s < sessions[1])]
    return rows


def index_end(g: CardGraph, ivf: CausalIVF, block_sessions: int) -> int:
    """The session at which a walk over ``ivf`` starts: the end of the complete grid blocks it holds (0 when
    untrained). An index whose nodes are not whole blocks of ``g``'s sessions raises: it is not this graph's."""
    if ivf.index is None:
        return 0
    ends = np.append(g.starts, g.nodes.shape[0])
    s = int(np.searchsorted(ends, ivf.ntotal))
    if s >= ends.size or int(ends[s]) != ivf.ntotal or s % block_sessions:
        raise ValueError(f"an IVF index of {ivf.ntotal} nodes is not whole {block_sessions}-session blocks of "
                         f"this card graph ({g.n_sessions} sessions, {g.nodes.shape[0]} nodes)")
    return s


def _walk(g: CardGraph, rows: np.ndarray, k: int, p: IVFParams, ivf: CausalIVF | None = None) -> Candidates:
    """IVF candidates of ``rows`` (all past the exact prefix): the grid walk from the end of ``ivf`` (session 0
    when it is None or untrained) to the graph's last session."""
    ivf = CausalIVF(g.nodes.shape[1], p) if ivf is None else ivf
    out = [_select(g.nodes, r, found, blk, c0, k) for _, r, found, blk, c0 in grid_found(g, rows, k, p, ivf)]
    return _concat(out, k)


def grid_found(g: CardGraph, rows: np.ndarray, k: int, p: IVFParams, ivf: CausalIVF
               ) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray, int]]:
    """The grid walk from the end of ``ivf`` (trained on the prefix first when untrained) to the graph's last
    session, per grid block holding rows of ``rows``: (its first session, those rows, the node ids each found
    (-1: none) before the exact rescoring, the block's nodes, its first node). The index takes each complete
    block as the walk passes it: the task's walk (:func:`_walk`) and the driver's search of an append's rows
    (``walk_found`` in the job's ``history_index/card_ivf.py``) are this one walk."""
    E, n = g.nodes, g.nodes.shape[0]
    before = g.starts[g.session]
    ends = np.append(g.starts, n)  # session s holds the nodes [ends[s], ends[s + 1])
    fetch = p.fetch or int(k) + int(k) // 2
    start = index_end(g, ivf, p.block_sessions)
    if int(g.session[rows[0]]) < start:
        raise ValueError(f"row {int(rows[0])} is in session {int(g.session[rows[0]])}, before the end of the "
                         f"IVF index it would search (session {start})")
    with ivf._threads():
        if ivf.index is None:
            ivf.train(_Prefix(E, min(n, p.train_nodes)))
        ivf.index.nprobe = min(p.nprobe, ivf.nlist)
        for s0 in range(start, g.n_sessions, p.block_sessions):
            s1 = min(g.n_sessions, s0 + p.block_sessions)
            c0, c1 = int(ends[s0]), int(ends[s1])
            blk = _read_cols(E, c0, c1)
            lists, dis = ivf.coarse(E, c0, c1, blk)
            lo, hi = np.searchsorted(rows, [c0, c1])
            if hi > lo:
                r = rows[lo:hi]
                pos = r - c0
                found = []
                if ivf.ntotal:
                    _, i = ivf.index.search_preassigned(blk[pos], min(fetch, ivf.ntotal), lists[pos], dis[pos])
                    found.append(i.astype(np.int64))  # -1 where the probed lists hold fewer
                inb = ivf._in_block(blk[pos], pos, blk, lists, fetch, lim=before[r] - c0)
                found.append(np.where(inb >= 0, inb + c0, -1))
                yield s0, r, np.concatenate(found, 1), blk, c0
            if s1 - s0 == p.block_sessions:  # complete blocks only: a partial one stays out, as in a longer history
                ivf._add(blk, lists[:, 0])


def card_graph_recall(g: CardGraph, got: Candidates, sample: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per ``sample`` row (sorted, among ``got.rows``): (hits, total) of the exact search's candidates that
    ``got`` holds (:func:`~memgas.pipeline.association.ivf_search.candidate_hits` with the graph's prefixes)."""
    return candidate_hits(g.nodes, got, sample, k, before=g.starts[g.session[sample]])
