"""The associate stage: GMM association edges per history, computed only for rows whose edges are not stored.

Edges are stored per segment (the rows of sessions ``[a, b)`` of a history, valid while the nodes of
sessions ``[0, b)`` are unchanged: see :mod:`memgas.pipeline.association.segments`), a *segmented* table
(:mod:`memgas.jobs.tables`). The stage's parts are named by its config (its key), not by what it read, so
after ``memgas ingest --append`` the segments of the old sessions stay current and only the new sessions' rows are computed; anything that
changed an old session's nodes (another encoder, a reordered history) makes its segments stale, and they
are recomputed and dropped. The search is always the exact causal one, whose result for a row does not
depend on which other rows one call computes (canonical shapes), so the edges of ``A`` then an append of
``B`` equal those of one build over ``A + B`` byte for byte.

Node vectors: a history whose prefix is longer than one block
(:data:`memgas.pipeline.association.blocks.BLOCK_ROWS` rows) reaches the task as
:class:`~memgas.pipeline.association.blocks.NodeBlocks`, read from the bank block by block (its vectors
gathered in one pass over ``embeddings``, :mod:`memgas.pipeline.spilled_vectors`) and put into Ray's object
store once per block (spilled to files in-process, :mod:`memgas.jobs.stages.node_blocks`);
the task fetches one block at a time. Neither the driver nor a task holds the history's matrix, and the
edges are those of the whole matrix byte for byte (the searches' tiles, chunks and grid blocks are fixed by
node ids). Both searches: a long history's new rows are cut into several units, one Ray task each.

``association.search: ivf`` (faiss IVF on the CPU, :func:`memgas.pipeline.association.ivf_search.ivf_rows`):
rows past a history's first ``ivf_exact_nodes`` nodes search an IVF index trained on those nodes. The index
is saved per history (table ``ivf_index``, only the newest on a history's chain of current segments kept),
verified before use (a damaged one is rebuilt, never searched), and walked on a fixed grid of session
blocks, so an append over the saved index equals a fresh build byte for byte. The candidate recall against
the exact search is measured on a sample of each history's IVF rows that does not depend on the cut: every
node row has a fixed key (a seeded hash of the history and the node id,
:func:`~memgas.pipeline.association.ivf_search.row_keys`), a history's sample is its
:data:`~memgas.pipeline.association.ivf_search.RECALL_ROWS` rows of smallest key, and each of those is among
the smallest of its own unit's rows. So each unit checks only its own bottom-k rows (at most ``RECALL_ROWS``
exact rows) and stores one row per sampled node row (table ``ivf_recall``); ``finish`` and the run's
metrics.json / report.md keep each history's bottom-k of its current segments' rows (:func:`ivf_recall`):
the same numbers for one build, several units, or a build then appends. An append saves only the entries it
added to the index, as a delta (table ``ivf_delta``, :data:`IVF_MAX_DELTAS`): merged into the full index in
order, the same bytes as the index of one build.

*One IVF history, several units.* The index a row searches holds the complete grid blocks before the row's
own block, so the units of one history need the index state at their first row. They are not chained (the
executor runs a plan's units independently, in any order, on any worker, and resumes any subset): each unit
*rebuilds* that state itself. It starts from the history's saved index when there is one (every unit of a
run may: it ends at or before the run's first row), else it trains the centroids on the exact prefix (seeded
k-means, one thread: the same bits in every unit), and then adds the grid blocks between the index's end and
its rows (coarse lists and add, no search); :func:`ivf_rows` does both on its way. Only the history's last
unit saves its index: the one a fresh build would save, byte for byte (the others would be superseded at
once). The price, paid for the parallelism and the bounded units: a unit that starts at node ``r`` with no
saved index repeats the training (``ivf_exact_nodes x nlist x d`` multiply-adds per k-means iteration) and
the coarse assignment of ``r`` nodes (``r x nlist x d``, one BLAS product per grid block). Arithmetic, not
measured: a fresh 10^6-session build with the defaults (8 units, nlist 2048, d 384, 25 k-means iterations)
repeats 7 trainings (~1.3e12 multiply-adds each) and ~1.2e13 multiply-adds of coarse products, about 4x the
coarse products a one-task build computes (3.1e12) and more than its SQ8 list scans (~1e13); an append (its
units start from the saved index) repeats no training and walks only from the saved index on. Units are
therefore long and fixed: :data:`~memgas.pipeline.association.segments.IVF_UNIT_SESSIONS` (131,072 sessions)
per unit, cut at its multiples. A task's memory is then one node block, the unit's candidates and the index,
which grows with the history (SQ8: ``d + 8`` bytes a node, a quarter of the float32 matrix, more while
faiss's lists keep spare capacity); a saved index is read, verified and put into the object store once per
history and run, and every unit of that history shares it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs import tables
from memgas.jobs.stage import Active, Stage, StageContext
from memgas.jobs.stages.block_store import chains
from memgas.jobs.stages.node_blocks import HistoryBlocks, history_nodes, keep_blocks
from memgas.jobs.stages.shards import kernel_active, matrix_loader, node_matrix, owned
from memgas.jobs.units import chunk
from memgas.kernels.backend import one_blas_thread
from memgas.pipeline.association import blocks, segments
from memgas.pipeline.association.blocks import NodeBlocks, is_object_ref
from memgas.pipeline.association.segments import (
    Coverage,
    Segment,
    coverage,
    split_every,
    split_segment,
)
from memgas.pipeline.errors import BankError
from memgas.pipeline.schema import EDGE_MODES, EDGE_SEGMENTS, EDGES, IVF_DELTA, IVF_INDEX, IVF_RECALL, N_GRAN

log = logging.getLogger(__name__)

MODES = EDGE_MODES  # the method's edges and those of the "no GMM" ablation


# -- which segments are stored and which must be computed ----------------------------------------------
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


def _current_recall(ctx: StageContext, prefix: str) -> list[str]:
    """The recall rows of the current segments (a part of the same name as their edges)."""
    return [p for p in _current(ctx, prefix) if ctx.bank.has_part("ivf_recall", p)]


def _index_rows(ctx: StageContext, part: str) -> list[tuple[str, int, int, str]]:
    """(history, end_session, sessions, prefix digest) of an ``ivf_index`` part, without its index bytes."""
    t = ctx.bank.read("ivf_index", ["history_id", "end_session", "sessions", "prefix_digest"], parts=[part])
    return list(zip(*(t[c].to_pylist() for c in ("history_id", "end_session", "sessions", "prefix_digest"))))


def current_indexes(ctx: StageContext, prefix: str) -> dict[str, tuple[str, int, str]]:
    """Per history, its newest full saved IVF index: ``(part, sessions, prefix digest)``, the one of most
    sessions among the current segments' parts whose sessions are still those it holds (an older one is
    superseded; the deltas saved since continue it, :func:`current_deltas`)."""
    cov, chain = current_coverage(ctx, prefix), chains(ctx)
    found: dict[str, list[tuple[int, str, str]]] = {}
    for part in cov.parts:
        if not ctx.bank.has_part("ivf_index", part):
            continue
        for h, _, sessions, digest in _index_rows(ctx, part):
            c = chain.get(h)
            if c is not None and sessions < len(c) and c[sessions] == digest:
                found.setdefault(h, []).append((sessions, part, digest))
    out = {}
    for h, candidates in found.items():
        # the most sessions among those whose bytes are those written: a damaged part is never current, so
        # the index rebuilt over it (maybe of as many sessions) replaces it instead of tying with it
        for sessions, part, digest in sorted(candidates, key=lambda x: (-x[0], x[1])):
            if _intact(ctx, "ivf_index", part, h):
                out[h] = (part, sessions, digest)
                break
    return out


def _intact(ctx: StageContext, table: str, part: str, history: str) -> bool:
    """Whether a saved index (or delta) part's bytes are those written; a damaged one is logged and counted
    once per run (``ivf_index_rebuilt``) and never used: the task rebuilds what it held."""
    if ctx.bank.verify_part(table, part):
        return True
    seen = ctx.scratch.setdefault("ivf_damaged", set())
    if (table, part) not in seen:
        seen.add((table, part))
        log.warning("associate: the saved IVF %s of history %s (%s/%s) is damaged; rebuilding it",
                    "index" if table == "ivf_index" else "delta", history, table, part)
        ctx.scratch["ivf_rebuilt"] = ctx.scratch.get("ivf_rebuilt", 0) + 1
    return False


def current_deltas(ctx: StageContext, prefix: str) -> dict[str, list[tuple[str, int, int, str]]]:
    """Per history, the deltas that continue its full index (:func:`current_indexes`), in order:
    ``(part, base sessions, sessions, prefix digest)``, each starting where the one before ends, its sessions
    still those it holds. Of two from the same start (one written over a damaged one) the longer."""
    cov, chain, full = current_coverage(ctx, prefix), chains(ctx), current_indexes(ctx, prefix)
    nxt: dict[tuple[str, int], tuple[str, int, int, str]] = {}
    for part in cov.parts:
        if not ctx.bank.has_part("ivf_delta", part):
            continue
        t = ctx.bank.read("ivf_delta", ["history_id", "base_sessions", "sessions", "prefix_digest"], parts=[part])
        for h, base, sessions, digest in zip(*(t[c].to_pylist() for c in t.column_names)):
            c = chain.get(h)
            if c is not None and base < sessions < len(c) and c[sessions] == digest and \
                    nxt.get((h, base), ("", 0, -1))[2] < sessions and _intact(ctx, "ivf_delta", part, h):
                nxt[(h, base)] = (part, base, sessions, digest)
    out: dict[str, list[tuple[str, int, int, str]]] = {}
    for h, (_, sessions, _) in full.items():
        links, at = [], sessions
        while (h, at) in nxt:
            links.append(nxt[(h, at)])
            at = links[-1][2]
        out[h] = links
    return out


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
#: an append saves the entries it added to a history's index as a delta (table ``ivf_delta``) beside the full
#: index it started from, not the whole index again: at 10^6 sessions that index is ~1.5 GB (~30 s to write)
#: and an append of 1,000 sessions adds ~1.6 MB. A full index is saved again once the deltas since the last one
#: would be more than IVF_MAX_DELTAS, or hold more than a 1/IVF_DELTA_SHARE of its sessions, so that a load
#: merges a few small deltas. Where the index is saved as what changes nothing downstream: the merged index
#: is the same bytes either way.
IVF_MAX_DELTAS = 16
IVF_DELTA_SHARE = 8
#: an IVF unit is shipped only the rows it found (AssociateStage._found) when the blocks from its index's end
#: to its last row are at most this many: the driver holds them at once to search (an append of up to ~48,000
#: sessions at 16,384 sessions a block; a longer unit, the later units of a long append, ship every block)
FOUND_TAIL_BLOCKS = 4


def uses_ivf(cfg: Any, end_session: int) -> bool:
    """Whether a segment ending at ``end_session`` has rows past the exact prefix under ``cfg``."""
    a = cfg.association
    return a.search == "ivf" and N_GRAN * end_session > a.ivf_exact_nodes


def ivf_recall(ctx: StageContext) -> dict[str, Any]:
    """The candidate recall of the current IVF segments (empty under the exact search or when no history
    reached the exact prefix's end): what metrics.json and report.md say the approximation costs.

    Per history, its sample is the :data:`~memgas.pipeline.association.ivf_search.RECALL_ROWS` smallest
    row keys among the rows its current segments stored (each unit stored its own smallest): the same rows,
    hence the same counts, whether the history was built at once, in several units or by appends."""
    from memgas.pipeline.association import ivf_search

    if ctx.cfg.association.search != "ivf" or ctx.fingerprints.get("associate") in (None, "disabled"):
        return {}
    parts = tables.current_parts(ctx, "ivf_recall")
    if not parts:
        return {}
    t = ctx.bank.read("ivf_recall", ["history_id", "key", "hits", "total"], parts=parts)
    hist = np.asarray(t["history_id"].to_pylist(), dtype=object)
    keep = ivf_search.history_sample(hist, t["key"].to_numpy(), ivf_search.RECALL_ROWS)
    x, n = t["hits"].to_numpy()[keep].astype(np.int64), t["total"].to_numpy()[keep].astype(np.int64)
    _, code = np.unique(hist[keep], return_inverse=True)
    per = zip(np.bincount(code, x).tolist(), np.bincount(code, n).tolist())  # exact: integer sums below 2**53
    worst = min((a / b for a, b in per if b), default=None)
    hits, total = int(x.sum()), int(n.sum())
    return {"ivf_recall_k": ctx.cfg.association.mem_threshold, "ivf_recall": hits / total if total else None,
            "ivf_recall_min_history": worst, "ivf_recall_rows": int(keep.size),
            "ivf_recall_histories": int(code.max(initial=-1)) + 1}


def association_info(ctx: StageContext) -> dict[str, Any]:
    """The candidate search of this config and, under IVF, its parameters and measured recall
    (metrics.json ``run.association``, one line of report.md)."""
    a = ctx.cfg.association
    if a.search != "ivf":
        return {"search": a.search}
    return {"search": a.search, "ivf_nlist": a.ivf_nlist, "ivf_nprobe": a.ivf_nprobe,
            "ivf_exact_nodes": a.ivf_exact_nodes, **ivf_recall(ctx)}


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
            from memgas.pipeline.association import ivf_search

            # The recall sample (the rows of each history's smallest row keys; table ivf_recall stores one row
            # per sampled node row) enters the IVF key only: its old per-unit sample and schema (one row per
            # segment) are then never current, and the next run recomputes the IVF segments and drops their
            # parts (the segmented table keeps only current parts), while exact banks keep their key and edges.
            # Not `version` (in every key) nor `params` (in none). The sample size and seed enter too: the
            # stored rows are each unit's bottom-k for this k, which report time's bottom-k must not exceed.
            k = ivf_search.RECALL_ROWS
            active.resolved["recall_sample"] = {"method": "bottom-k-row-hash", "rows": k,
                                                "seed": ivf_search.RECALL_SEED}
            active.params["recall_rows"] = k  # the driver's constant (a task may run in another process)
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
            if a >= s:
                continue
            if uses_ivf(ctx.cfg, s):  # each unit rebuilds the index at its first row: fixed, longer units
                pieces = split_every(a, s, segments.IVF_UNIT_SESSIONS)
            else:
                pieces = split_segment(a, s, segments.UNIT_WORK, segments.TILE_SESSIONS)
            segs = [[h, x, y, c[y]] for x, y in pieces]
            if len(segs) == 1:
                small.append(segs[0])
            else:
                large += [[seg] for seg in segs]
        groups = chunk(small, ctx.cfg.ray.shard_size) + large
        return [{"size": len(g), "segments": g} for g in groups]

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        """Each segment's rows see the nodes of its sessions ``[0, end)``: only that prefix is shipped. A
        prefix longer than one block (``blocks.BLOCK_ROWS`` rows), exact or IVF, goes as :class:`NodeBlocks`
        (read, put and fetched block by block: :mod:`memgas.jobs.stages.node_blocks`); a shorter one as one
        matrix read with the unit's other histories. Under IVF each segment also gets the history's saved
        index (read and verified once per history and run, put once into Ray's object store when a unit
        searches it: :meth:`_found`'s units get the rows found and the delta instead), the IVF grid
        (module constants are the driver's: a task may run in another process) and whether its index is the
        one to save (the history's last segment only)."""
        segs = unit["segments"]
        whole = [N_GRAN * b <= blocks.BLOCK_ROWS for _, _, b, _ in segs]
        loader = matrix_loader(ctx, sorted({s[0] for s, w in zip(segs, whole) if w})) if any(whole) else None
        keep_blocks(ctx, {s[0] for s, w in zip(segs, whole) if not w})
        out: dict[str, Any] = {"segments": segs}
        if ctx.cfg.association.search == "ivf":
            from memgas.pipeline.association import ivf_search

            chain, grid = chains(ctx), ivf_search.STAGE_BLOCK_SESSIONS
            if "ivf_saved" not in ctx.scratch:  # the indexes saved before this run: listed before any unit is written
                prefix = tables.prefix(AssociateStage, ctx)
                ctx.scratch["ivf_saved"] = current_indexes(ctx, prefix)
                ctx.scratch["ivf_deltas"] = current_deltas(ctx, prefix)
            # the saved index to start from (or None), the identity of the nodes the new one will hold, and
            # whether to save it: only the history's last segment's index is current (and kept)
            out["indexes"] = []
            for h, a, b, _ in segs:
                if not uses_ivf(ctx.cfg, b):
                    out["indexes"].append(None)
                    continue
                saved, end, save = self._saved_index(ctx, h, a), ivf_search.index_sessions(b, grid), b == len(chain[h]) - 1
                out["indexes"].append({"saved": saved, "grid": grid, "save": save, "digest": chain[h][end],
                                       "delta": save and _saves_delta(saved, end)})
        # an IVF append over a saved index gets only the rows its new rows found (ivf_found) before the
        # index's end, not the history's matrix: at 10^6 sessions ~3% of it instead of ~6 GB through the store
        found = [None if w else self._found(ctx, seg, m) for seg, w, m in
                 zip(segs, whole, out.get("indexes") or [None] * len(segs))]
        out["matrices"] = [node_matrix(loader.get(h))[: N_GRAN * b] if w else f[0] if f is not None
                           else history_nodes(ctx, h, N_GRAN * b) for (h, _, b, _), w, f in zip(segs, whole, found)]
        out["found"] = [None if f is None else f[1] for f in found]
        for i, (meta, f) in enumerate(zip(out.get("indexes") or [], found)):
            if f is not None:  # searched here: the task gets the delta to save, not the index
                out["indexes"][i] = {**meta, "saved": None, "base_sessions": meta["saved"]["sessions"],
                                     "found_delta": f[2]}
            elif meta is not None and meta["saved"] is not None:
                out["indexes"][i] = {**meta, "saved": self._shipped(ctx, meta["saved"])}
        return out

    @staticmethod
    def _shipped(ctx: StageContext, saved: dict[str, Any]) -> dict[str, Any]:
        """The saved index as a task gets it: under Ray its bytes put into the object store once per run and
        history (every unit of the history shares the reference)."""
        if not ctx.use_ray:
            return saved
        ref = ctx.scratch.get("ivf_put")
        if ref is None or ref[0] is not saved:
            import ray

            ref = ctx.scratch["ivf_put"] = (saved, ray.put(saved["bytes"]))
        return {**saved, "bytes": ref[1]}

    @staticmethod
    def _found(ctx: StageContext, seg: list[Any], meta: dict[str, Any] | None
               ) -> tuple[NodeBlocks, dict, np.ndarray | None] | None:
        """For an IVF segment of a long history over a saved index (an append): what its rows find in the
        index (:func:`~memgas.pipeline.association.ivf_search.ivf_found`, searched here once, on the blocks
        from the index's end), and the node blocks that hold those rows and that tail only
        (:meth:`~memgas.jobs.stages.node_blocks.HistoryBlocks.sparse_nodes`). None where the task needs every
        row: no saved index, rows of the exact prefix, a row of the recall sample (it is checked against the
        exact search), a block before the index's end not stored (the first append after 10^6 sessions
        were indexed gathers and stores them), or a full index to save (past the delta limits: the task
        builds it). The walk adds the complete grid blocks as the task's would, so the delta to save (when
        this segment saves one) is made here too: third in the tuple, and the task then needs no index."""
        from memgas.pipeline.association import ivf_search as I

        a, (h, s0, s1, _) = ctx.cfg.association, seg
        saved = meta["saved"] if meta is not None else None
        if saved is None or N_GRAN * s0 < a.ivf_exact_nodes:
            return None
        params = I.stage_params(a.ivf_nlist, a.ivf_nprobe, a.ivf_exact_nodes, meta["grid"])
        rows = I.index_rows(N_GRAN * s0, N_GRAN * s1, params, a.min_prior_nodes)
        sample, _ = I.recall_sample(h, rows, I.RECALL_ROWS, first_row=I.first_ivf_row(a.ivf_exact_nodes,
                                                                                        a.min_prior_nodes))
        if not rows.size or sample.size:
            return None
        end = I.index_sessions(s1, meta["grid"])
        if meta["save"] and end > saved["sessions"] and not meta["delta"]:
            return None
        B, n = blocks.BLOCK_ROWS, N_GRAN * s1
        first = N_GRAN * saved["sessions"] // B  # the block holding the index's end
        if -(-n // B) - first > FOUND_TAIL_BLOCKS:
            return None
        hb = HistoryBlocks(ctx, h, B)
        if not hb.all_stored(first):
            return None
        tail = hb.read_blocks(first, n)
        dim = tail[first].shape[1]
        index = AssociateStage._loaded_index(saved, params, dim)
        if meta["delta"]:
            index.start_delta()
        found = I.ivf_found(NodeBlocks([None] * first + [tail[i] for i in sorted(tail)], B, n, dim),
                            N_GRAN * s0, n, index, mem_threshold=a.mem_threshold, min_prior_nodes=a.min_prior_nodes,
                            params=params)
        if index.ntotal != N_GRAN * end:
            raise RuntimeError(f"associate: the IVF index of history {h} holds {index.ntotal // N_GRAN} sessions "
                               f"after the walk, expected {end}")
        delta = I.delta_bytes(index) if meta["delta"] else None
        del index
        need = I.found_before(found, first * B)
        nodes = hb.sparse_nodes(n, tail, need)
        if nodes is None:
            return None
        log.info("associate: history %s: %d of the %d node rows before row %d shipped (those found), and %d "
                 "blocks whole", h, need.size, first * B, first * B, len(tail))
        ctx.scratch["ivf_found_units"] = ctx.scratch.get("ivf_found_units", 0) + 1
        return nodes, found, delta

    @staticmethod
    def _loaded_index(saved: dict[str, Any], params: Any, dim: int) -> Any:
        """The saved index (a :class:`~memgas.pipeline.association.ivf_search.CausalIVF`) with its deltas
        merged in order, from :meth:`_saved_index`'s bytes (an object reference under Ray)."""
        from memgas.pipeline.association import ivf_search as I

        data = saved["bytes"]
        if is_object_ref(data):
            import ray

            data = ray.get(data)
        index = I.index_from_bytes(data, params, d=dim, ntotal=N_GRAN * saved.get("full_sessions", saved["sessions"]))
        del data
        for delta in saved.get("deltas", []):
            index.merge_delta(I.raw_from_bytes(delta["bytes"], d=dim, ntotal=N_GRAN * (delta["sessions"] - delta["base"])))
        return index

    @staticmethod
    def _saved_index(ctx: StageContext, history: str, start: int) -> dict[str, Any] | None:
        """The history's saved IVF index for rows from session ``start`` on, its part verified first (a part
        whose bytes are not those written is never searched: the task rebuilds the index, and the stats
        count it); None when there is none to use. Every unit of the history in this run starts from the
        same saved index (it ends at or before the first unit's rows): it is read, verified and counted once
        (the last history's, kept in the scratch as bytes; :meth:`_shipped` puts them into Ray's store once)."""
        saved = ctx.scratch["ivf_saved"].get(history)  # listed by inputs before the run's first unit
        if start == 0 or saved is None:
            return None
        loaded = ctx.scratch.get("ivf_loaded")
        if loaded is not None and loaded[0] == history:
            return loaded[1]
        ctx.scratch["ivf_loaded"] = (history, None)  # drops the previous history's bytes first
        part, sessions, digest = saved
        if not _intact(ctx, "ivf_index", part, history):  # listed intact (current_indexes): changed since
            return None
        meta = ctx.bank.read("ivf_index", ["history_id", "sessions", "prefix_digest", "dim"], parts=[part])
        meta = meta.filter(pc.equal(meta["history_id"], history))
        if meta.num_rows == 0 or {(s, d) for s, d in zip(meta["sessions"].to_pylist(), meta["prefix_digest"].to_pylist())} \
                != {(sessions, digest)}:
            return None
        data: Any = saved_index_bytes(ctx.bank, part, history)
        deltas = []
        for dpart, base, end, _ in ctx.scratch["ivf_deltas"].get(history, []):
            if not _intact(ctx, "ivf_delta", dpart, history):  # the index up to here, then its blocks added again
                break
            deltas.append({"base": base, "sessions": end, "bytes": saved_index_bytes(ctx.bank, dpart, history,
                                                                                       "ivf_delta")})
        ctx.scratch["ivf_reused"] = ctx.scratch.get("ivf_reused", 0) + 1
        ctx.scratch["ivf_loaded"] = (history, {"sessions": deltas[-1]["sessions"] if deltas else sessions,
                                               "full_sessions": sessions, "dim": meta["dim"][0].as_py(),
                                               "bytes": data, "deltas": deltas})
        return ctx.scratch["ivf_loaded"][1]

    @staticmethod
    def run(model: None, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.association import causal_rows
        from memgas.pipeline.association.edges import edges_from

        a, device, segs = params["association"], params["device"], payload["segments"]
        ivf: dict[str, list] = {"index": [], "delta": [], "recall": []}
        with one_blas_thread():
            cands = []
            for i, (m, seg) in enumerate(zip(payload["matrices"], segs)):
                E, (_, s0, s1, _) = m if isinstance(m, NodeBlocks) else owned(m, np.float32), seg
                if a["search"] == "ivf" and N_GRAN * s1 > a["ivf_exact_nodes"]:
                    cands.append(AssociateStage._ivf_segment(E, seg, payload["indexes"][i], a, ivf,
                                                             params.get("recall_rows"),
                                                             (payload.get("found") or [None] * len(segs))[i]))
                else:
                    cands.append(causal_rows(E, N_GRAN * s0, N_GRAN * s1, mem_threshold=a["mem_threshold"],
                                             min_prior_nodes=a["min_prior_nodes"], device=device))
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
        out = {"edges": pa.table(cols, schema=EDGES), "edge_segments": segs_table}
        if ivf["recall"]:
            out["ivf_recall"] = pa.concat_tables(ivf["recall"])
        if ivf["index"]:
            out["ivf_index"] = _index_table(ivf["index"])
        if ivf["delta"]:
            out["ivf_delta"] = _index_table(ivf["delta"], IVF_DELTA)
        return out

    @staticmethod
    def _ivf_segment(E: np.ndarray, seg: list[Any], meta: dict[str, Any], a: dict[str, Any],
                     out: dict[str, list], recall_rows: int | None = None, found: dict | None = None) -> Any:
        """One segment under the IVF search: its candidates; its index (to save, when it is the history's
        last segment) and recall rows (its IVF rows of the ``recall_rows`` smallest row keys, None:
        :data:`~memgas.pipeline.association.ivf_search.RECALL_ROWS`) go to ``out``. The index at the
        segment's first row is the saved one (or trained afresh on the exact prefix: the same bits), plus the
        grid blocks between its end and the segment's rows, which :func:`ivf_rows` adds on its way (coarse
        lists and add, no search)."""
        from memgas.pipeline.association import ivf_search as I
        h, s0, s1, _ = seg
        saved, grid = meta["saved"], meta.get("grid") or I.STAGE_BLOCK_SESSIONS
        params = I.stage_params(a["ivf_nlist"], a["ivf_nprobe"], a["ivf_exact_nodes"], grid)
        if found is not None:  # the driver searched (AssociateStage._found): rescore, save its delta if any
            c, _ = I.ivf_rows(E, N_GRAN * s0, N_GRAN * s1, None, mem_threshold=a["mem_threshold"],
                              min_prior_nodes=a["min_prior_nodes"], params=params, found=found)
            AssociateStage._recall_rows(E, c, seg, a, out, recall_rows)
            if meta.get("found_delta") is not None:
                out["delta"].append({"history_id": h, "end_session": s1, "sessions": I.index_sessions(s1, grid),
                                     "prefix_digest": meta["digest"], "dim": E.shape[1],
                                     "base_sessions": meta["base_sessions"], "index": meta["found_delta"]})
            return c
        index = None
        if saved is not None:
            index = AssociateStage._loaded_index(saved, params, E.shape[1])
            if meta.get("delta"):
                index.start_delta()
        c, index = I.ivf_rows(E, N_GRAN * s0, N_GRAN * s1, index, mem_threshold=a["mem_threshold"],
                              min_prior_nodes=a["min_prior_nodes"], params=params, found=found)
        AssociateStage._recall_rows(E, c, seg, a, out, recall_rows)
        if meta.get("save", True) and index is not None and index.index is not None:
            sessions = index.ntotal // N_GRAN
            if sessions != I.index_sessions(s1, grid):
                raise RuntimeError(f"associate: the IVF index of history {h} holds {sessions} sessions, "
                                   f"expected {I.index_sessions(s1, grid)}")
            row = {"history_id": h, "end_session": s1, "sessions": sessions, "prefix_digest": meta["digest"],
                   "dim": E.shape[1]}
            if saved is not None and sessions == saved["sessions"]:
                pass  # no grid block was completed: the saved index (and its deltas) stays the current one
            elif index.delta is not None:
                out["delta"].append({**row, "base_sessions": saved["sessions"], "index": I.delta_bytes(index)})
            else:
                out["index"].append({**row, "index": I.index_bytes(index)})
        return c  # the faiss index is freed here: only its bytes stay, until the table is written

    @staticmethod
    def _recall_rows(E: Any, c: Any, seg: list[Any], a: dict[str, Any], out: dict[str, list],
                     recall_rows: int | None) -> None:
        """The segment's rows of the recall sample, checked against the exact search, into ``out``."""
        from memgas.pipeline.association import ivf_search as I

        h, s0, s1, _ = seg
        approx = c.rows[c.rows >= a["ivf_exact_nodes"]]
        sample, keys = I.recall_sample(h, approx, I.RECALL_ROWS if recall_rows is None else recall_rows,
                                       first_row=I.first_ivf_row(a["ivf_exact_nodes"], a["min_prior_nodes"]))
        hits, total = I.candidate_hits(E, c, sample, a["mem_threshold"])
        n = sample.size
        out["recall"].append(pa.table([[h] * n, [s0] * n, [s1] * n, sample, keys, hits, total], schema=IVF_RECALL))

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        """Count the current edges (the segmented table's kind dropped every part that is not current)."""
        current = sorted(tables.current_parts(ctx, "edges"))
        # dedupe=False: current segments never share an edge (jobs/stages/rank.py: edges_of)
        edges = ctx.bank.read("edges", ["mode"], parts=current, dedupe=False) if current else None
        count = {m: int(pc.sum(pc.equal(edges["mode"], m)).as_py() or 0) if edges is not None else 0 for m in MODES}
        out = {"edges_gmm": count["gmm"], "edges_topk": count["topk"], "topk_edges": ctx.cfg.association.topk_edges,
               "search": ctx.cfg.association.search}
        if ctx.cfg.association.search == "ivf":
            out.update(ivf_recall(ctx), ivf_index_reused=ctx.scratch.get("ivf_reused", 0),
                       ivf_index_rebuilt=ctx.scratch.get("ivf_rebuilt", 0),
                       ivf_found_units=ctx.scratch.get("ivf_found_units", 0))
        return out


#: bytes of a saved index per ``ivf_index`` row: an index is stored as its chunks, in order, one row (and one
#: Parquet row group, bank.ROW_GROUP_ROWS) each, so that writing and reading it hold one chunk beside it
IVF_INDEX_CHUNK_BYTES = 64 << 20


def _saves_delta(saved: dict[str, Any] | None, end: int) -> bool:
    """Whether the index that holds ``end`` sessions is saved as a delta over ``saved`` (the full index and
    the deltas it was loaded with) rather than whole (:data:`IVF_MAX_DELTAS`, :data:`IVF_DELTA_SHARE`)."""
    if saved is None or end <= saved["sessions"]:
        return False
    full = saved.get("full_sessions", saved["sessions"])
    return len(saved.get("deltas", [])) < IVF_MAX_DELTAS and (end - full) * IVF_DELTA_SHARE <= full


def _index_table(rows: list[dict[str, Any]], schema: pa.Schema = IVF_INDEX) -> pa.Table:
    """The ``ivf_index`` rows: per saved index, its bytes (a uint8 array) in chunks of at most
    :data:`IVF_INDEX_CHUNK_BYTES`, one row each (the other columns repeated), wrapped by Arrow without a copy
    when there is one index (a long history's unit saves one: ``Table.from_pylist`` would copy it twice)."""
    blobs = [r["index"] for r in rows]
    data = blobs[0] if len(blobs) == 1 else np.concatenate(blobs)
    cuts, owner = [0], []
    for i, b in enumerate(blobs):
        n = max(1, -(-b.size // IVF_INDEX_CHUNK_BYTES))
        cuts += [cuts[-1] + min(b.size, (j + 1) * IVF_INDEX_CHUNK_BYTES) for j in range(n)]
        owner += [i] * n
    offsets = np.asarray(cuts, np.int64)
    index = pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(owner),
                                             [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    cols = [pa.array([rows[i][f.name] for i in owner], f.type) for f in schema if f.name != "index"]
    return pa.Table.from_arrays([*cols, index], schema=schema)


def saved_index_bytes(bank: Any, part: str, history: str, table: str = "ivf_index") -> np.ndarray:
    """The saved index of ``history`` in ``part``: its rows' bytes in row order (one row in parts written
    before the chunks), read a row at a time into one buffer: a first pass sums their lengths, a second
    copies them, so no more than one chunk is held beside the buffer."""
    def chunks() -> Iterator[pa.Array]:
        for t in bank.iter_read(table, ["history_id", "index"], batch_rows=1, parts=[part]):
            yield t.filter(pc.equal(t["history_id"], history))["index"]

    total = sum(int(pc.sum(pc.binary_length(c)).as_py() or 0) for c in chunks())
    out, at = np.empty(total, np.uint8), 0
    for c in chunks():
        for v in c:
            b = np.frombuffer(v.as_buffer(), np.uint8)
            out[at : at + b.size] = b
            at += b.size
    if at != total:
        raise BankError(f"{bank.path}: {table}/{part} changed while it was read")
    return out
