"""memgas-cards' IVF append over a saved index: MemGAS's found path
(:func:`~memgas.jobs.history_index.ivf_units.found`) with the card graph's layout and walk.

For a segment of a long history whose rows are past the exact prefix, over the history's saved index, the
driver walks the grid blocks from the index's end once (:func:`walk_found`: the walk of
:mod:`memgas.pipeline.card_graph_ivf`, up to the ids each row found, before their exact rescoring), on the
card graph's stored blocks from that end (:class:`~memgas.jobs.history_index.card_blocks.CardGraphBlocks`),
with the saved index read whole (:func:`~memgas.jobs.history_index.ivf_units.driver_index`; not mapped:
:func:`card_found` says why). The task is then shipped the ids found, the rows among them before the index's
end and the blocks after it (not the history's matrix, nor the index), the delta to save, and the recall
sample's exact candidates, searched here on the stored blocks; it rescores the ids found (:func:`found_rows`)
as the walk would have: the same candidates, byte for byte. Where the driver cannot (no saved index, a block
before it not stored, a full index to save), the task walks as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from memgas.jobs.history_index.card_blocks import CardGraphBlocks, layout
from memgas.jobs.history_index.ivf_units import FoundGraph, searched
from memgas.jobs.stage import StageContext
from memgas.pipeline.association import ivf_search as I
from memgas.pipeline.association.ivf_search import (
    CausalIVF,
    IVFParams,
    _concat,
    _select,
)
from memgas.pipeline.association.nodes import Candidates, _read_cols
from memgas.pipeline.card_graph import CardGraph
from memgas.pipeline.card_graph_ivf import grid_found, ivf_rows

STAGE = "card-graph-associate"


def card_found(ctx: StageContext, seg: list[Any], meta: dict[str, Any] | None, blocks: CardGraphBlocks
               ) -> tuple[Any, dict[int, np.ndarray], np.ndarray | None, tuple | None] | None:
    """:func:`~memgas.jobs.history_index.ivf_units.found` for a segment of the card graph whose blocks are
    ``blocks``: (the nodes to ship, the ids found per grid block, the delta to save, the recall sample's
    exact search), or None where the task needs every row."""
    a, (h, s0, s1, _) = ctx.cfg.association, seg
    saved = meta["saved"] if meta is not None else None
    if saved is None or blocks.nodes_of(s0) < a.ivf_exact_nodes:
        return None
    p = I.stage_params(a.ivf_nlist, a.ivf_nprobe, a.ivf_exact_nodes, meta["grid"])
    g = CardGraph(**layout(blocks, s1, None))  # the layout alone: what the rows and the sample are cut from
    rows = ivf_rows(g, a.min_prior_nodes, p, (s0, s1))
    first = ivf_rows(g, a.min_prior_nodes, p)  # the history's first IVF row, as the task's sample takes it
    sample, _ = I.recall_sample(h, rows, I.RECALL_ROWS, first_row=int(first[0]) if first.size else None)
    if not rows.size:
        return None

    def walk(E: Any, index: CausalIVF) -> dict[int, np.ndarray]:
        return walk_found(CardGraph(E, g.gran, g.session, g.starts), rows, a.mem_threshold, p, index)

    # the saved index read whole, not mapped: a mapped index is searched through faiss's HStackInvertedLists,
    # which copies each probed list for each row, and the card graph's lists can be skewed (on the synthetic
    # encoder's vectors at 10^5 sessions the largest of 1,680 lists held 90,683 of 794,624 nodes: the walk's
    # search took 26 s mapped, 4.5 s read whole, as the task read it before)
    graph = FoundGraph(lambda: blocks, walk, nodes=blocks.nodes_of, before=g.starts[g.session[sample]],
                       mapped=False, stage=STAGE)
    return searched(ctx, seg, meta, graph, sample)  # a damaged stored block: None, the task gets every block


def walk_found(g: CardGraph, rows: np.ndarray, k: int, p: IVFParams, ivf: CausalIVF) -> dict[int, np.ndarray]:
    """What the walk of :mod:`memgas.pipeline.card_graph_ivf` finds for ``rows`` (all past the exact prefix)
    from the end of the saved index ``ivf`` (which it fills as that walk does), per grid block (its first
    session): each row's ids (-1: none) before the exact rescoring. ``g.nodes`` needs only the nodes from
    the index's end."""
    if ivf.index is None:
        raise ValueError("the driver's IVF walk continues a saved index; it trains none")
    return {s0: found for s0, _, found, _, _ in grid_found(g, rows, k, p, ivf)}


def found_rows(g: CardGraph, rows: np.ndarray, k: int, found: dict[int, np.ndarray], block_sessions: int
               ) -> Candidates:
    """The candidates of ``rows`` given what :func:`walk_found` found for them: the walk's exact rescoring
    (``_select`` per grid block), no index. ``found`` must hold every grid block of ``rows``, each with its
    rows; ``g.nodes`` the rows found before the blocks and the blocks themselves."""
    E, n = g.nodes, g.nodes.shape[0]
    ends = np.append(g.starts, n)
    out, seen = [], 0
    for s0 in sorted(found):
        s1 = min(g.n_sessions, s0 + block_sessions)
        c0, c1 = int(ends[s0]), int(ends[s1])
        lo, hi = (int(x) for x in np.searchsorted(rows, [c0, c1]))
        if s0 % block_sessions or found[s0].shape[0] != hi - lo or hi == lo:
            raise ValueError(f"the IVF ids found for the block at session {s0} are not those of its rows")
        out.append(_select(E, rows[lo:hi], found[s0], _read_cols(E, c0, c1), c0, int(k)))
        seen += hi - lo
    if seen != rows.size:
        raise ValueError(f"the IVF ids found hold {seen} of the {rows.size} rows asked for")
    return _concat(out, int(k))
