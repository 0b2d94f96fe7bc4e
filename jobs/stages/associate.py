"""The associate stage: GMM association edges per history, computed only for rows whose edges are not stored.

Edges are stored per segment (the rows of sessions ``[a, b)`` of a history, valid while the nodes of
sessions ``[0, b)`` are unchanged: see :mod:`memgas.pipeline.association.segments`), a *segmented* table
(:mod:`memgas.jobs.tables`). The stage's parts are named by its config (its key), not by what it read, so
after ``memgas ingest --append`` the segments of the old sessions stay current and only the new sessions'
rows are computed; anything that changed an old session's nodes (another encoder, a reordered history) makes
its segments stale, and they are recomputed and dropped. The search is always the exact causal one, whose
result for a row does not depend on which other rows one call computes (canonical shapes), so the edges of
``A`` then an append of ``B`` equal those of one build over ``A + B`` byte for byte.

What a history keeps between runs besides its edges (its node blocks, its saved IVF index and deltas) and
what a task is shipped of it are :mod:`memgas.jobs.history_index`'s: a prefix longer than one block reaches
the task as :class:`~memgas.pipeline.association.blocks.NodeBlocks`, and under ``association.search: ivf``
each segment gets the history's saved index (or the rows an append found in it). This module declares the
stage's tables and calls that package; the recall of the IVF search against the exact one is measured on a
sample of each history's rows that does not depend on the cut
(:func:`memgas.jobs.history_index.ivf_units.ivf_recall`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs import tables
from memgas.jobs.history_index import history_nodes, ivf_mapped, ivf_store, ivf_units, keep_blocks
from memgas.jobs.history_index.prefixes import chains, stored_segments
from memgas.jobs.stage import Active, Stage, StageContext
from memgas.jobs.stages.shards import edge_tables, kernel_active, matrix_loader, node_matrix, owned, segment_units
from memgas.kernels.backend import one_blas_thread
from memgas.pipeline import association
from memgas.pipeline.association import blocks, ivf_search, row_keys, segments
from memgas.pipeline.association.edges import edges_from
from memgas.pipeline.association.blocks import NodeBlocks
from memgas.pipeline.association.segments import Coverage, coverage, split_every, split_segment
from memgas.pipeline.schema import EDGE_MODES, IVF_DELTA, N_GRAN

MODES = EDGE_MODES  # the method's edges and those of the "no GMM" ablation


# -- which segments are stored and which must be computed ----------------------------------------------
def current_coverage(ctx: StageContext, prefix: str) -> Coverage:
    return coverage(stored_segments(ctx, prefix), chains(ctx))


def current_indexes(ctx: StageContext, prefix: str) -> dict[str, tuple[str, int, str]]:
    """Per history, its current full saved IVF index (:func:`memgas.jobs.history_index.ivf_store.current_indexes`)."""
    return ivf_store.current_indexes(ctx, current_coverage(ctx, prefix), chains(ctx))


def current_deltas(ctx: StageContext, prefix: str) -> dict[str, list[tuple[str, int, int, str]]]:
    """Per history, the deltas that continue its full index
    (:func:`memgas.jobs.history_index.ivf_store.current_deltas`)."""
    return ivf_store.current_deltas(ctx, current_coverage(ctx, prefix), chains(ctx))


def _current(ctx: StageContext, prefix: str) -> list[str]:
    return list(current_coverage(ctx, prefix).parts)


def _current_recall(ctx: StageContext, prefix: str) -> list[str]:
    """The recall rows of the current segments (a part of the same name as their edges)."""
    return [p for p in _current(ctx, prefix) if ctx.bank.has_part("ivf_recall", p)]


def _current_index(ctx: StageContext, prefix: str) -> list[str]:
    return sorted({part for part, _, _ in current_indexes(ctx, prefix).values()})


def _current_delta(ctx: StageContext, prefix: str) -> list[str]:
    return sorted({link[0] for links in current_deltas(ctx, prefix).values() for link in links})


#: which rows' edges a part holds (written after the part's edges: a unit is done when it is there)
EDGE_SEGMENTS_TABLE = tables.Table("edge_segments", "segmented", current=_current)
EDGES_TABLE = tables.Table("edges", "segmented", current=_current)
#: association.search=ivf: each history's saved index (the newest only) and each segment's recall sample
IVF_INDEX_TABLE = tables.Table("ivf_index", "segmented", current=_current_index)
#: ... and the entries each append added since that index, as small indexes of their own
IVF_DELTA_TABLE = tables.Table("ivf_delta", "segmented", current=_current_delta)
IVF_RECALL_TABLE = tables.Table("ivf_recall", "segmented", current=_current_recall)
IVF_FIELDS = ("association.ivf_nlist", "association.ivf_nprobe", "association.ivf_exact_nodes")


class AssociateStage(Stage):
    """Per history: GMM association edges (and the top-k edges of the "no GMM" ablation) of the rows not
    yet stored, one batched GMM fit per unit."""

    name = "associate"
    version = "2"  # parts per segment, named by config (version 1: one set of parts per upstream state)
    reads = ("nodes", "node_vectors", "pairs")  # node matrices: which texts (nodes, pairs) and their vectors
    writes = (EDGE_SEGMENTS_TABLE, EDGES_TABLE, IVF_INDEX_TABLE, IVF_DELTA_TABLE, IVF_RECALL_TABLE)
    fields = ("association.mem_threshold", "association.min_prior_nodes", "association.topk_edges",
              "association.search", *IVF_FIELDS, "retrieval.device")

    def active(self, ctx: StageContext) -> Active:
        active = kernel_active(ctx)
        active.params["association"] = ctx.cfg.association.model_dump()
        if ctx.cfg.association.search != "ivf":
            # the IVF's parameters change nothing under the exact search; nor does the mode itself enter the
            # key there, so banks associated before the option existed keep their edges (the same key)
            active.fields = tuple(f for f in self.fields if f not in ("association.search", *IVF_FIELDS))
        else:
            # The recall sample (the rows of each history's smallest row keys; table ivf_recall stores one row
            # per sampled node row) enters the IVF key only: its old per-unit sample and schema (one row per
            # segment) are then never current, and the next run recomputes the IVF segments and drops their
            # parts (the segmented table keeps only current parts), while exact banks keep their key and edges.
            # Not `version` (in every key) nor `params` (in none). The sample size and seed enter too: the
            # stored rows are each unit's bottom-k for this k, which report time's bottom-k must not exceed.
            k = ivf_search.RECALL_ROWS
            active.resolved["recall_sample"] = {"method": "bottom-k-row-hash", "rows": k,
                                                "seed": row_keys.RECALL_SEED}
            active.params["recall_rows"] = k  # the driver's constant (a task may run in another process)
        return active

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        """Units of new segments: each history's rows from the end of its current segments to its last
        session; small ones ``ray.shard_size`` histories to a unit, a huge one cut into several units."""
        prefix = tables.prefix(self, ctx)
        cov = current_coverage(ctx, prefix)
        chain = chains(ctx)

        def pieces(h: str, a: int, s: int) -> list[tuple[int, int]]:
            if ivf_units.uses_ivf(ctx.cfg, s):  # each unit rebuilds the index at its first row: fixed, longer units
                return split_every(a, s, segments.IVF_UNIT_SESSIONS)
            return split_segment(a, s, segments.UNIT_WORK, segments.TILE_SESSIONS)

        return segment_units(chain, cov.covered, pieces, ctx.cfg.ray.shard_size)

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        """Each segment's rows see the nodes of its sessions ``[0, end)``: only that prefix is shipped. A
        prefix longer than one block (``blocks.BLOCK_ROWS`` rows), exact or IVF, goes as :class:`NodeBlocks`
        (:func:`memgas.jobs.history_index.history_nodes`); a shorter one as one matrix read with the unit's
        other histories. Under IVF each segment also gets its index entry
        (:func:`~memgas.jobs.history_index.ivf_units.segment_indexes`): an append over a saved index only
        the rows its new rows found before the index's end, not the history's matrix
        (:func:`~memgas.jobs.history_index.ivf_units.found`: at 10^6 sessions ~3% of it)."""
        segs = unit["segments"]
        whole = [N_GRAN * b <= blocks.BLOCK_ROWS for _, _, b, _ in segs]
        loader = matrix_loader(ctx, sorted({s[0] for s, w in zip(segs, whole) if w})) if any(whole) else None
        keep_blocks(ctx, {s[0] for s, w in zip(segs, whole) if not w})
        out: dict[str, Any] = {"segments": segs}
        if ctx.cfg.association.search == "ivf":
            prefix = tables.prefix(AssociateStage, ctx)
            out["indexes"] = ivf_units.segment_indexes(
                ctx, segs, lambda: (current_indexes(ctx, prefix), current_deltas(ctx, prefix)))
        found = [None if w else ivf_units.found(ctx, seg, m) for seg, w, m in
                 zip(segs, whole, out.get("indexes") or [None] * len(segs))]
        out["matrices"] = [node_matrix(loader.get(h))[: N_GRAN * b] if w else f[0] if f is not None
                           else history_nodes(ctx, h, N_GRAN * b) for (h, _, b, _), w, f in zip(segs, whole, found)]
        out["found"] = [None if f is None else f[1] for f in found]
        if "indexes" in out:
            out["indexes"] = [ivf_units.shipped(ctx, m, f) for m, f in zip(out["indexes"], found)]
        return out

    @staticmethod
    def run(model: None, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        a, device, segs = params["association"], params["device"], payload["segments"]
        ivf: dict[str, list] = {"index": [], "delta": [], "recall": []}
        with one_blas_thread():
            cands = []
            for i, (m, seg) in enumerate(zip(payload["matrices"], segs)):
                E, (_, s0, s1, _) = m if isinstance(m, NodeBlocks) else owned(m, np.float32), seg
                if a["search"] == "ivf" and N_GRAN * s1 > a["ivf_exact_nodes"]:
                    cands.append(ivf_units.segment_candidates(E, seg, payload["indexes"][i], a, ivf,
                                                              params.get("recall_rows"),
                                                              (payload.get("found") or [None] * len(segs))[i]))
                else:
                    cands.append(association.causal_rows(E, N_GRAN * s0, N_GRAN * s1, mem_threshold=a["mem_threshold"],
                                                         min_prior_nodes=a["min_prior_nodes"], device=device))
            per_mode = {mode: edges_from(cands, mode, a["topk_edges"], device) for mode in MODES}
        edges, segs_table = edge_tables(segs, per_mode)
        out = {"edges": edges, "edge_segments": segs_table}
        if ivf["recall"]:
            out["ivf_recall"] = pa.concat_tables(ivf["recall"])
        if ivf["index"]:
            out["ivf_index"] = ivf_store.index_table(ivf["index"])
        if ivf["delta"]:
            out["ivf_delta"] = ivf_store.index_table(ivf["delta"], IVF_DELTA)
        return out

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        """Count the current edges (the segmented table's kind dropped every part that is not current)."""
        current = sorted(tables.current_parts(ctx, "edges"))
        # dedupe=False: current segments never share an edge (jobs/stages/rank.py: edges_of)
        edges = ctx.bank.read("edges", ["mode"], parts=current, dedupe=False) if current else None
        count = {m: int(pc.sum(pc.equal(edges["mode"], m)).as_py() or 0) if edges is not None else 0 for m in MODES}
        out = {"edges_gmm": count["gmm"], "edges_topk": count["topk"], "topk_edges": ctx.cfg.association.topk_edges,
               "search": ctx.cfg.association.search}
        if ctx.cfg.association.search == "ivf":
            out.update(ivf_units.ivf_recall(ctx), **ivf_store.ivf_run(ctx).stats())
        ivf_mapped.prune(ctx.bank)  # copies of saved indexes this run superseded (under any search)
        return out
