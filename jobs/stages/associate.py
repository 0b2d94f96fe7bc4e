"""The associate stage: GMM association edges per history, computed only for rows whose edges are not stored.

Edges are stored per segment (the rows of sessions ``[a, b)`` of a history, valid while the nodes of
sessions ``[0, b)`` are unchanged: see :mod:`memgas.pipeline.association.segments`), a *segmented* table
(:mod:`memgas.jobs.tables`). The stage's parts are named by its config (its key), not by what it read, so
after ``memgas ingest --append`` the segments of the old sessions stay current and only the new sessions' rows are computed; anything that
changed an old session's nodes (another encoder, a reordered history) makes its segments stale, and they
are recomputed and dropped. The search is always the exact causal one, whose result for a row does not
depend on which other rows one call computes (canonical shapes), so the edges of ``A`` then an append of
``B`` equal those of one build over ``A + B`` byte for byte.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs import tables
from memgas.jobs.keys import encoder_keys
from memgas.jobs.stage import Active, StageContext
from memgas.jobs.stages.shards import HistoryShardStage, matrix_loader, node_matrix, owned
from memgas.jobs.units import chunk
from memgas.kernels.backend import one_blas_thread
from memgas.pipeline.association import segments
from memgas.pipeline.association.segments import Coverage, Segment, coverage, prefix_digests, split_segment
from memgas.pipeline.schema import EDGE_SEGMENTS, EDGES, N_GRAN

MODES = ("gmm", "topk")  # the method's edges and those of the "no GMM" ablation


# -- which segments are stored and which must be computed ----------------------------------------------
def chains(ctx: StageContext) -> dict[str, list[str]]:
    """Per history, the prefix digests of its sessions (:func:`prefix_digests`). Plan, current parts and
    finish all need them: computed once per run and state of the nodes table (its committed digest)."""
    key = ("associate:chains", tables.read_digest(ctx, "nodes"), tuple(sorted(encoder_keys(ctx).items())))
    if key[1] is not None and key in ctx.cache:
        return ctx.cache[key]
    seed = "|".join(f"{k}={v}" for k, v in key[2])
    out = prefix_digests(ctx.bank.read("nodes", ["history_id", "position", "granularity", "text_hash"]), seed)
    if key[1] is not None:
        ctx.cache[key] = out
    return out


def stored_segments(ctx: StageContext, prefix: str) -> dict[str, list[Segment]]:
    """Segments of every part of this config whose edges part is there too."""
    bank, out = ctx.bank, {}
    for part in bank.parts("edge_segments"):
        if part.startswith(prefix) and bank.has_part("edges", part):
            t = bank.read("edge_segments", parts=[part])
            out[part] = list(zip(*(t[c].to_pylist() for c in EDGE_SEGMENTS.names)))
    return out


def current_coverage(ctx: StageContext, prefix: str) -> Coverage:
    return coverage(stored_segments(ctx, prefix), chains(ctx))


def _current(ctx: StageContext, prefix: str) -> list[str]:
    return list(current_coverage(ctx, prefix).parts)


#: which rows' edges a part holds (written after the part's edges: a unit is done when it is there)
EDGE_SEGMENTS_TABLE = tables.Table("edge_segments", "segmented", current=_current)
EDGES_TABLE = tables.Table("edges", "segmented", current=_current)


class AssociateStage(HistoryShardStage):
    """Per history: GMM association edges (and the top-k edges of the "no GMM" ablation) of the rows not
    yet stored, one batched GMM fit per unit."""

    name = "associate"
    version = "2"  # parts per segment, named by config (version 1: one set of parts per upstream state)
    reads = ("nodes", "node_vectors")  # node matrices: which texts (nodes) and their vectors
    writes = (EDGE_SEGMENTS_TABLE, EDGES_TABLE)
    fields = ("association.mem_threshold", "association.min_prior_nodes", "association.topk_edges",
              "retrieval.device")

    def active(self, ctx: StageContext) -> Active:
        active = super().active(ctx)
        active.params["association"] = ctx.cfg.association.model_dump()
        return active

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        """Units of new segments: each history's rows from the end of its current segments to its last
        session; small ones ``ray.shard_size`` histories to a unit, a huge one cut into several units."""
        prefix = tables.prefix(self, ctx)
        cov = current_coverage(ctx, prefix)
        chain = chains(ctx)
        small: list[list[Any]] = []
        large: list[list[list[Any]]] = []
        for h in sorted(chain):
            c = chain[h]
            a, s = cov.covered.get(h, 0), len(c) - 1
            pieces = split_segment(a, s, segments.UNIT_WORK, segments.TILE_SESSIONS) if a < s else []
            segs = [[h, x, y, c[y]] for x, y in pieces]
            if len(segs) == 1:
                small.append(segs[0])
            else:
                large += [[seg] for seg in segs]
        groups = chunk(small, ctx.cfg.ray.shard_size) + large
        return [{"size": len(g), "segments": g} for g in groups]

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        segs = unit["segments"]
        loader = matrix_loader(ctx, sorted({s[0] for s in segs}))
        # each segment's rows see the nodes of its sessions [0, end): only that prefix is shipped
        return {"segments": segs, "matrices": [node_matrix(loader.get(h))[: N_GRAN * b] for h, _, b, _ in segs]}

    @staticmethod
    def run(model: None, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.association import causal_rows
        from memgas.pipeline.association.edges import edges_from

        a, device, segs = params["association"], params["device"], payload["segments"]
        with one_blas_thread():
            cands = [causal_rows(owned(m, np.float32), N_GRAN * s0, N_GRAN * s1, mem_threshold=a["mem_threshold"],
                                 min_prior_nodes=a["min_prior_nodes"], device=device)
                     for m, (_, s0, s1, _) in zip(payload["matrices"], segs)]
            per_mode = {mode: edges_from(cands, mode, a["topk_edges"], device) for mode in MODES}
        cols: dict[str, list] = {"history_id": [], "src": [], "dst": [], "similarity": [], "mode": []}
        for mode, edges in per_mode.items():
            for (h, *_), e in zip(segs, edges):
                n = len(e.src)
                cols["history_id"] += [h] * n
                cols["src"] += e.src.tolist()
                cols["dst"] += e.dst.tolist()
                cols["similarity"] += e.sim.tolist()
                cols["mode"] += [mode] * n
        segs_table = pa.table([list(c) for c in zip(*segs)] if segs else [[] for _ in EDGE_SEGMENTS.names],
                            schema=EDGE_SEGMENTS)
        return {"edges": pa.table(cols, schema=EDGES), "edge_segments": segs_table}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        """Count the current edges (the segmented table's kind dropped every part that is not current)."""
        current = sorted(tables.current_parts(ctx, "edges"))
        edges = ctx.bank.read("edges", ["mode"], parts=current) if current else None
        count = {m: int(pc.sum(pc.equal(edges["mode"], m)).as_py() or 0) if edges is not None else 0 for m in MODES}
        return {"edges_gmm": count["gmm"], "edges_topk": count["topk"], "topk_edges": ctx.cfg.association.topk_edges}
