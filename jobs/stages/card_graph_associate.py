"""card-graph-associate: per history, the GMM edges of memgas-cards' five-granularity graph
(:mod:`memgas.jobs.stages.card_graph` holds the graph's loading and the stages' shared functions).

The edges are segmented as MemGAS's (:mod:`memgas.jobs.stages.associate`, the same machinery): a part holds
the edges of the rows of sessions ``[a, b)`` of its histories, valid while the card graph of sessions
``[0, b)`` (each session's MemGAS nodes and cards, in order: :func:`~memgas.jobs.stages.card_graph.card_chains`)
is unchanged. Parts are named by the stage's key, so after ``memgas ingest --append`` the old sessions'
segments stay current and only the new sessions' rows are searched; the search's canonical shapes make a
row's candidates independent of which rows one call computes, so an append equals a fresh build byte for byte.

Under ``association.search: ivf`` each history's IVF index is saved as MemGAS's is
(:mod:`memgas.jobs.history_index.ivf_store`, :mod:`~memgas.jobs.history_index.ivf_units`), in tables of its
own (``card_graph_ivf_index``, ``card_graph_ivf_delta``: :data:`CARD_IVF`) named by the card graph's prefix
digests: the unit that ends a history saves the index its walk left (whole, or as a delta over the saved one
it started from), and an append's units start from it and walk only the grid blocks from its end.

What an append costs follows what it adds, as MemGAS's: a long history's card-graph blocks are stored
(:mod:`memgas.jobs.history_index.card_blocks`: only the appended sessions' rows are built), and over a saved
index the driver searches the appended rows once and ships the task what they found
(:mod:`memgas.jobs.history_index.card_ivf`, MemGAS's found path).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
from memgas.jobs import tables
from memgas.jobs.history_index import ivf_store, ivf_units
from memgas.jobs.history_index.card_blocks import CardGraphBlocks, card_graph_blocks, layout, matrix_blocks
from memgas.jobs.history_index.card_ivf import card_found, found_rows
from memgas.jobs.history_index.prefixes import stored_segments
from memgas.jobs.stage import Active, Stage, StageContext
from memgas.jobs.stages.associate import IVF_FIELDS
from memgas.jobs.stages.card_graph import (card_chains, card_graph_enabled, card_graphs, card_sizes,
                                           session_card_hashes)
from memgas.jobs.stages.shards import edge_tables, kernel_active, segment_units
from memgas.kernels.backend import one_blas_thread
from memgas.pipeline.association import blocks, ivf_search, row_keys, segments
from memgas.pipeline.association.segments import Coverage, coverage, split_every, split_sized
from memgas.pipeline.schema import IVF_DELTA, IVF_RECALL, N_GRAN


# -- which segments are stored and which must be computed ------------------------------------------------------
def card_coverage(ctx: StageContext, prefix: str) -> Coverage:
    """The current parts of the card graph's edges under ``prefix`` and the sessions they cover per history."""
    return coverage(stored_segments(ctx, prefix, "card_graph_edge_segments", "card_graph_edges"), card_chains(ctx))


def _current(ctx: StageContext, prefix: str) -> list[str]:
    return list(card_coverage(ctx, prefix).parts)


#: the tables of the card graph's saved IVF indexes and their deltas (schemas IVF_INDEX and IVF_DELTA)
CARD_IVF = ivf_store.IVFTables("card_graph_ivf_index", "card_graph_ivf_delta")


def current_indexes(ctx: StageContext, prefix: str) -> dict[str, tuple[str, int, str]]:
    """Per history, its current full saved IVF index of the card graph
    (:func:`memgas.jobs.history_index.ivf_store.current_indexes` under :func:`card_chains`)."""
    return ivf_store.current_indexes(ctx, card_coverage(ctx, prefix), card_chains(ctx), CARD_IVF)


def current_deltas(ctx: StageContext, prefix: str) -> dict[str, list[tuple[str, int, int, str]]]:
    """Per history, the deltas that continue its full index (:func:`~memgas.jobs.history_index.ivf_store.current_deltas`)."""
    return ivf_store.current_deltas(ctx, card_coverage(ctx, prefix), card_chains(ctx), CARD_IVF)


def _saved(ctx: StageContext, table: str, prefix: str) -> bool:
    """Whether ``table`` has a part of this key (a directory listing: under the exact search none, and the
    edges' coverage is not computed for it)."""
    return any(p.startswith(prefix) for p in ctx.bank.parts(table))


def _current_index(ctx: StageContext, prefix: str) -> list[str]:
    if not _saved(ctx, CARD_IVF.index, prefix):
        return []
    return sorted({part for part, _, _ in current_indexes(ctx, prefix).values()})


def _current_delta(ctx: StageContext, prefix: str) -> list[str]:
    if not _saved(ctx, CARD_IVF.delta, prefix):
        return []
    return sorted({link[0] for links in current_deltas(ctx, prefix).values() for link in links})


def _current_recall(ctx: StageContext, prefix: str) -> list[str]:
    """The recall rows of the current segments (a part of the same name as their edges)."""
    return [p for p in _current(ctx, prefix) if ctx.bank.has_part("card_graph_ivf_recall", p)]


#: which rows' edges a part holds (written after the part's edges: a unit is done when it is there)
CARD_GRAPH_EDGE_SEGMENTS = tables.Table("card_graph_edge_segments", "segmented", current=_current)
CARD_GRAPH_EDGES = tables.Table("card_graph_edges", "segmented", current=_current)
#: association.search=ivf: each segment's recall sample (:func:`memgas.jobs.history_index.ivf_units.ivf_recall`)
CARD_GRAPH_IVF_RECALL = tables.Table("card_graph_ivf_recall", "segmented", current=_current_recall)
#: ... each history's saved index (the newest only) and the deltas appends saved since
CARD_GRAPH_IVF_INDEX = tables.Table(CARD_IVF.index, "segmented", current=_current_index)
CARD_GRAPH_IVF_DELTA = tables.Table(CARD_IVF.delta, "segmented", current=_current_delta)


def uses_ivf(ctx: StageContext, sizes: np.ndarray, end_session: int) -> bool:
    """Whether a segment of a card graph (``sizes``: its sessions' nodes) ending at ``end_session`` has rows
    past the exact prefix (:func:`~memgas.jobs.history_index.ivf_units.uses_ivf`, with cards)."""
    return ivf_units.past_exact_prefix(ctx.cfg, int(sizes[:end_session].sum()))


def history_blocks(ctx: StageContext, history: str) -> CardGraphBlocks:
    """The card graph blocks of a long history (:func:`~memgas.jobs.history_index.card_blocks.card_graph_blocks`,
    kept for its next unit), under its card-graph prefix digests and sizes."""
    return card_graph_blocks(ctx, history, blocks.BLOCK_ROWS, card_sizes(ctx)[history], card_chains(ctx)[history],
                             partial(session_card_hashes, ctx, history))


def graph_prefix(g: Any, end: int) -> dict[str, np.ndarray]:
    """The arrays of the card graph ``g`` of sessions ``[0, end)``: all a segment ending at ``end`` reads."""
    n = int(g.starts[end]) if end < g.n_sessions else g.nodes.shape[0]
    return {"nodes": g.nodes[:n], "gran": g.gran[:n], "session": g.session[:n], "starts": g.starts[:end]}


class CardGraphAssociateStage(Stage):
    """Per unit of new segments: the GMM association edges of their rows of each history's five-granularity
    graph (one batched GMM fit per unit, as the associate stage)."""

    name = "card-graph-associate"
    # 2: MemGAS's blocked causal search (canonical shapes: other float32 bits than the dense one at near-ties)
    # and segmented parts named by config (version 1: one per-fingerprint table)
    version = "2"
    reads = ("nodes", "node_vectors", "pairs", "cards", "card_graph_vectors", "histories")
    writes = (CARD_GRAPH_EDGE_SEGMENTS, CARD_GRAPH_EDGES, CARD_GRAPH_IVF_RECALL, CARD_GRAPH_IVF_INDEX,
              CARD_GRAPH_IVF_DELTA)
    fields = ("association.mem_threshold", "association.min_prior_nodes", "association.search", *IVF_FIELDS,
              "retrieval.device")

    def active(self, ctx: StageContext) -> Active | None:
        if not card_graph_enabled(ctx.cfg):
            return None
        active = kernel_active(ctx)
        a = ctx.cfg.association
        active.params.update(mem_threshold=a.mem_threshold, min_prior_nodes=a.min_prior_nodes, search=a.search)
        if a.search != "ivf":  # the IVF's parameters change nothing under the exact search (as associate's key)
            active.fields = tuple(f for f in self.fields if f not in ("association.search", *IVF_FIELDS))
        else:  # the rows past the exact prefix (pipeline/card_graph_ivf.py) and their recall sample
            active.params.update(ivf_nlist=a.ivf_nlist, ivf_nprobe=a.ivf_nprobe, ivf_exact_nodes=a.ivf_exact_nodes,
                                 ivf_grid=ivf_search.STAGE_BLOCK_SESSIONS, recall_rows=ivf_search.RECALL_ROWS)
            active.resolved["recall_sample"] = {"method": "bottom-k-row-hash", "rows": ivf_search.RECALL_ROWS,
                                                "seed": row_keys.RECALL_SEED}
        return active

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        """Units of new segments: each history's rows from the end of its current segments to its last session;
        small ones ``ray.shard_size`` histories to a unit, a long one cut into several of about equal work
        (:func:`~memgas.pipeline.association.segments.split_sized`: the cuts change the units, never the edges)."""
        cov = card_coverage(ctx, tables.prefix(self, ctx))
        chain, sizes = card_chains(ctx), card_sizes(ctx)

        def pieces(h: str, a: int, s: int) -> list[tuple[int, int]]:
            if uses_ivf(ctx, sizes[h], s):  # each unit rebuilds the index at its first row: fixed, longer units
                return split_every(a, s, segments.CARD_IVF_UNIT_SESSIONS)
            return split_sized(a, s, sizes[h], segments.UNIT_WORK, segments.TILE_SESSIONS)

        return segment_units(chain, cov.covered, pieces, ctx.cfg.ray.shard_size)

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        """Each segment's graph of sessions ``[0, end)``: only the prefix its rows see. A prefix longer than one
        block (``blocks.BLOCK_ROWS`` rows) goes as :class:`~memgas.pipeline.association.blocks.NodeBlocks`:
        the stored blocks of the card graph, those not stored yet built and stored, where its MemGAS nodes
        pass one block (:class:`~memgas.jobs.history_index.card_blocks.CardGraphBlocks`), else cut from the
        graph built whole; a shorter one as one matrix. Under IVF, each segment past the exact prefix also
        gets its index entry (:func:`~memgas.jobs.history_index.ivf_units.segment_indexes`: the history's
        saved index to start from, shared with the tasks once per run under Ray, and whether to save the one
        it leaves); an append over a saved index, the rows it found there instead, searched here once
        (:func:`~memgas.jobs.history_index.card_ivf.card_found`), and of the graph's nodes only those rows
        and the blocks from the index's end."""
        segs = unit["segments"]
        B = blocks.BLOCK_ROWS
        long = {s[0] for s in segs if N_GRAN * s[2] > B}
        whole = sorted({s[0] for s in segs} - long)
        graphs = card_graphs(ctx, whole) if whole else {}
        metas: list[dict[str, Any] | None] = [None] * len(segs)
        if ctx.cfg.association.search == "ivf":
            prefix, sizes = tables.prefix(CardGraphAssociateStage, ctx), card_sizes(ctx)
            metas = ivf_units.segment_indexes(
                ctx, segs, lambda: (current_indexes(ctx, prefix), current_deltas(ctx, prefix)),
                chain=card_chains(ctx), names=CARD_IVF,
                uses=lambda h, b: uses_ivf(ctx, sizes[h], b))
        out, found = [], []
        for seg, meta in zip(segs, metas):
            h, b = seg[0], seg[2]
            if h in long:
                hb = history_blocks(ctx, h)
                f = card_found(ctx, seg, meta, hb)
                out.append(hb.graph(b) if f is None else layout(hb, b, f[0]))
                found.append(f)
                continue
            g = graph_prefix(graphs[h][0], b)
            if g["nodes"].shape[0] > B:
                g["nodes"] = matrix_blocks(ctx, g["nodes"], B)
            out.append(g)
            found.append(None)
        payload: dict[str, Any] = {"segments": segs, "graphs": out,
                                   "found": [None if f is None else f[1] for f in found]}
        if ctx.cfg.association.search == "ivf":
            payload["indexes"] = [ivf_units.shipped(ctx, m, f) for m, f in zip(metas, found)]
        return payload

    @staticmethod
    def run(model: None, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.association.edges import edges_from
        from memgas.pipeline.card_graph import CardGraph

        segs = payload["segments"]
        ivf: dict[str, list] = {"index": [], "delta": [], "recall": []}
        indexes = payload.get("indexes") or [None] * len(segs)
        founds = payload.get("found") or [None] * len(segs)
        with one_blas_thread():
            cands = [_candidates(CardGraph.from_arrays(g), seg, params, ivf, meta, found)
                     for g, seg, meta, found in zip(payload["graphs"], segs, indexes, founds)]
            edges = edges_from(cands, "gmm", None, params["device"])
        edges_table, segs_table = edge_tables(segs, {"gmm": edges})
        out = {"card_graph_edges": edges_table, "card_graph_edge_segments": segs_table}
        if ivf["recall"]:
            out["card_graph_ivf_recall"] = pa.concat_tables(ivf["recall"])
        if ivf["index"]:
            out[CARD_IVF.index] = ivf_store.index_table(ivf["index"])
        if ivf["delta"]:
            out[CARD_IVF.delta] = ivf_store.index_table(ivf["delta"], IVF_DELTA)
        return out

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        """Count the current edges (the segmented table's kind dropped every part that is not current)."""
        current = sorted(tables.current_parts(ctx, "card_graph_edges"))
        # the current parts' row counts (their metadata), not a read of every edge (8 M at 120 histories: 1.9 GB
        # and 9 s in the driver when de-duplicated); current segments never share an edge
        n = sum(ctx.bank.part_rows("card_graph_edges", p) for p in current)
        out: dict[str, Any] = {"edges_gmm": n, "search": ctx.cfg.association.search}
        if ctx.cfg.association.search == "ivf":
            out.update(ivf_units.ivf_recall(ctx, "card_graph_ivf_recall", self.name), **ivf_store.ivf_run(ctx).stats())
        return out


def _candidates(g: Any, seg: list[Any], params: dict[str, Any], ivf: dict[str, list],
                meta: dict[str, Any] | None, found: dict[int, np.ndarray] | None = None) -> Any:
    """One segment's candidates: exact, or under the IVF search past the exact prefix the walk of
    :mod:`memgas.pipeline.card_graph_ivf` and the segment's recall rows (into ``ivf["recall"]``: its IVF rows of
    the ``recall_rows`` smallest row keys, checked against the exact search, as the associate stage's). The
    walk starts from the saved index in ``meta`` (its end: the grid blocks before it are not walked again) or
    trains its own, and the index it leaves goes to ``ivf`` when the segment saves it
    (:func:`~memgas.jobs.history_index.ivf_units.keep_index`). ``found``: what the rows found in the saved
    index, searched on the driver (:func:`~memgas.jobs.history_index.card_ivf.card_found`): rescored, no
    walk; the delta to save and the sample's exact candidates come with ``meta``."""
    from memgas.pipeline.card_graph import card_graph_candidates
    from memgas.pipeline.association.ivf_search import CausalIVF
    from memgas.pipeline.card_graph_ivf import card_graph_ivf_candidates, ivf_rows

    h, a, b, _ = seg
    kw = dict(mem_threshold=params["mem_threshold"], min_prior_nodes=params["min_prior_nodes"])
    if params["search"] != "ivf" or g.nodes.shape[0] <= params["ivf_exact_nodes"]:
        return card_graph_candidates(g, **kw, device=params["device"], sessions=(a, b))
    p = ivf_search.stage_params(params["ivf_nlist"], params["ivf_nprobe"], params["ivf_exact_nodes"],
                                params["ivf_grid"])
    if meta is None:  # the driver's card sizes said the prefix is exact: not this graph's
        raise RuntimeError(f"card-graph-associate: history {h}'s graph of sessions [0, {b}) holds "
                           f"{g.nodes.shape[0]} nodes, past the exact prefix, but was given no IVF index entry")
    if found is not None:
        c = found_rows(g, ivf_rows(g, params["min_prior_nodes"], p, (a, b)), params["mem_threshold"], found,
                       p.block_sessions)
        ivf_units.keep_found_delta(ivf, meta, seg, g.nodes.shape[1])
    else:
        nodes = partial(_nodes, np.append(g.starts, g.nodes.shape[0]))
        index = CausalIVF(g.nodes.shape[1], p)
        if meta["saved"] is not None:
            index = ivf_units.loaded_index(meta["saved"], p, g.nodes.shape[1], nodes)
            if meta.get("delta"):
                index.start_delta()
        c = card_graph_ivf_candidates(g, **kw, params=p, sessions=(a, b), index=index)
        ivf_units.keep_index(ivf, index, meta, seg, g.nodes.shape[1], nodes)
    first = ivf_rows(g, params["min_prior_nodes"], p)  # the history's first IVF row: earlier units' keys prune
    sample, keys = ivf_search.recall_sample(h, ivf_rows(g, params["min_prior_nodes"], p, (a, b)),
                                            params["recall_rows"], first_row=int(first[0]) if first.size else None)
    exact = meta.get("found_exact")
    if exact is not None and not np.array_equal(exact[0], sample):
        raise RuntimeError(f"card-graph-associate: the recall sample searched on the driver ({exact[0].size} rows) "
                           f"is not the segment's ({sample.size} rows) for history {h}")
    hits, total = ivf_search.candidate_hits(g.nodes, c, sample, params["mem_threshold"],
                                            before=g.starts[g.session[sample]],
                                            exact=None if exact is None else exact[1:])
    n = sample.size
    ivf["recall"].append(pa.table([[h] * n, [a] * n, [b] * n, sample, keys, hits, total], schema=IVF_RECALL))
    return c


def _nodes(ends: np.ndarray, sessions: int) -> int:
    """The nodes of a card graph's first ``sessions`` sessions (``ends``: its session starts and node count)."""
    return int(ends[sessions])
