"""An IVF unit of the associate stage: what the driver ships (the saved index, or the rows an append
found in it) and what the task does with it (load, walk, save the index or its delta, check the recall
sample).

*One IVF history, several units.* The index a row searches holds the complete grid blocks before the row's
own block, so the units of one history need the index state at their first row. They are not chained (the
executor runs a plan's units independently, in any order, on any worker, and resumes any subset): each unit
*rebuilds* that state itself. It starts from the history's saved index when there is one (every unit of a
run may: it ends at or before the run's first row), else it trains the centroids on the exact prefix (seeded
k-means, one thread: the same bits in every unit), and then adds the grid blocks between the index's end and
its rows (coarse lists and add, no search); :func:`~memgas.pipeline.association.ivf_search.ivf_rows` does
both on its way. Only the history's last unit saves its index: the one a fresh build would save, byte for
byte. A saved index is read, verified and shared with the tasks once per history and run.

*An append is shipped the rows it found* (:func:`found`): for a unit over a saved index whose blocks before
the index's end are all stored, the driver walks the grid once and ships the ids each new row found, the
delta to save, and of each stored block only the rows among them; the task rescores from them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from memgas.jobs import executor, tables
from memgas.jobs.history_index import ivf_mapped
from memgas.jobs.history_index.ivf_store import IVF_TABLES, IVFTables, full_bytes, ivf_run, saved_index, saves_delta
from memgas.jobs.history_index.node_blocks import HistoryBlocks
from memgas.jobs.history_index.prefixes import chains
from memgas.jobs.stage import StageContext
from memgas.kernels.backend import one_blas_thread
from memgas.pipeline.association import blocks
from memgas.pipeline.association import ivf_search as I
from memgas.pipeline.association.blocks import NodeBlocks
from memgas.pipeline.association.faiss_index import raw_from_file
from memgas.pipeline.errors import BankError
from memgas.pipeline.schema import IVF_RECALL, N_GRAN

log = logging.getLogger(__name__)

#: an IVF unit is shipped only the rows it found (:func:`found`) when the blocks from its index's end to its
#: last row are at most this many: the driver holds them at once to search (an append of up to ~48,000
#: sessions at 16,384 sessions a block; a longer unit, the later units of a long append, ship every block)
FOUND_TAIL_BLOCKS = 4


def uses_ivf(cfg: Any, end_session: int) -> bool:
    """Whether a segment ending at ``end_session`` has rows past the exact prefix under ``cfg``."""
    return past_exact_prefix(cfg, N_GRAN * end_session)


def past_exact_prefix(cfg: Any, nodes: int) -> bool:
    """Whether a graph prefix of ``nodes`` nodes (MemGAS's four a session, or memgas-cards' with its cards) has
    rows past the exact prefix under ``cfg``'s IVF search."""
    a = cfg.association
    return a.search == "ivf" and nodes > a.ivf_exact_nodes


# -- the driver ----------------------------------------------------------------------------------------
def segment_indexes(ctx: StageContext, segs: list[list[Any]], listed: Any, *,
                    chain: dict[str, list[str]] | None = None, uses: Callable[[str, int], bool] | None = None,
                    names: IVFTables = IVF_TABLES) -> list[dict[str, Any] | None]:
    """Per segment of a unit: None under the exact search, else the saved index to start from (or None), the
    IVF grid (module constants are the driver's: a task may run in another process), the identity of the
    nodes the new index will hold, and whether to save it (only the history's last segment's index is
    current, and kept) and as a delta. ``listed``: called once per run, before any unit is written, for
    the indexes and deltas saved before this run (``(current_indexes, current_deltas)``). Another graph's
    (memgas-cards'): its prefix digests ``chain``, whether a segment ``(history, end)`` has rows past the
    exact prefix (``uses``) and its tables (``names``); MemGAS's by default."""
    run, grid = ivf_run(ctx), I.STAGE_BLOCK_SESSIONS
    chain = chains(ctx) if chain is None else chain
    if run.saved is None:
        run.saved, run.deltas = listed()
    out: list[dict[str, Any] | None] = []
    for h, a, b, _ in segs:
        if not (uses_ivf(ctx.cfg, b) if uses is None else uses(h, b)):
            out.append(None)
            continue
        saved, end, save = saved_index(ctx, h, a, names), I.index_sessions(b, grid), b == len(chain[h]) - 1
        out.append({"saved": saved, "grid": grid, "save": save, "digest": chain[h][end],
                    "delta": save and saves_delta(saved, end)})
    return out


def shipped(ctx: StageContext, meta: dict[str, Any] | None, found: tuple | None) -> dict[str, Any] | None:
    """A segment's index entry as its task gets it: after :func:`found` searched here, the delta to save and
    no index; else the saved index, under Ray shared through the executor once per run and history (every
    unit of the history shares the reference)."""
    if found is not None:
        return {**meta, "saved": None, "base_sessions": meta["saved"]["sessions"], "found_delta": found[2],
                "found_exact": found[3]}
    if meta is None or meta["saved"] is None:
        return meta
    run, saved = ivf_run(ctx), meta["saved"]
    if not ctx.use_ray:
        return {**meta, "saved": {**saved, "bytes": full_bytes(ctx, saved)}}
    if run.shared is None or run.shared[0] is not saved:
        run.shared = None  # drops the previous history's reference first
        run.shared = (saved, executor.share(full_bytes(ctx, saved)))
    return {**meta, "saved": {**saved, "bytes": run.shared[1]}}


def found(ctx: StageContext, seg: list[Any], meta: dict[str, Any] | None
          ) -> tuple[NodeBlocks, dict, np.ndarray | None, tuple | None] | None:
    """For an IVF segment of a long history over a saved index (an append): what its rows find in the
    index (:func:`~memgas.pipeline.association.ivf_search.ivf_found`, searched here once, on the blocks
    from the index's end), and the node blocks that hold those rows and that tail only
    (:meth:`~memgas.jobs.history_index.node_blocks.HistoryBlocks.sparse_nodes`). None where the task needs
    every row: no saved index, rows of the exact prefix, a block before the index's end not stored (the
    first append after 10^6 sessions were indexed gathers and stores them), or a full index to save (past
    the delta limits: the task builds it). The walk adds the complete grid blocks as the task's would, so
    the delta to save (when this segment saves one) is made here too: third in the tuple, and the task then
    needs no index. Rows of the recall sample are checked against the exact search, which reads every row:
    the driver runs it here, on the stored blocks it reads anyway for the rows found (one read each,
    :meth:`~memgas.jobs.history_index.node_blocks.HistoryBlocks.streamed`), with one BLAS thread like a
    task, and ships ``(sample, cand, valid)`` fourth (None without such rows)."""
    a, (h, s0, s1, _) = ctx.cfg.association, seg
    saved = meta["saved"] if meta is not None else None
    if saved is None or N_GRAN * s0 < a.ivf_exact_nodes:
        return None
    params = I.stage_params(a.ivf_nlist, a.ivf_nprobe, a.ivf_exact_nodes, meta["grid"])
    rows = I.index_rows(N_GRAN * s0, N_GRAN * s1, params, a.min_prior_nodes)
    sample, _ = I.recall_sample(h, rows, I.RECALL_ROWS, first_row=I.first_ivf_row(a.ivf_exact_nodes,
                                                                                    a.min_prior_nodes))
    if not rows.size:
        return None

    def walk(E: NodeBlocks, index: Any) -> dict[int, np.ndarray]:
        return I.ivf_found(E, N_GRAN * s0, N_GRAN * s1, index, mem_threshold=a.mem_threshold,
                           min_prior_nodes=a.min_prior_nodes, params=params)

    return searched(ctx, seg, meta, FoundGraph(lambda: HistoryBlocks(ctx, h, blocks.BLOCK_ROWS), walk), sample)


@dataclass(frozen=True)
class FoundGraph:
    """What :func:`searched` needs of a graph: MemGAS's (four nodes a session, :func:`found`) or
    memgas-cards' (sessions of any size, :mod:`~memgas.jobs.history_index.card_ivf`). ``history_blocks``
    makes the history's blocks (the stored ones read, the tail from the index's end built);
    ``walk(nodes, index)``: what the segment's rows find, per grid block, walking ``index`` over ``nodes``
    (the blocks from the index's end); ``nodes(s)``: the nodes of the first ``s`` sessions (None: four a
    session); ``before``: the recall sample's prefixes for the exact search (None: four nodes a session);
    ``mapped``: the saved index searched as a mapped copy, else read whole (:func:`driver_index`);
    ``stage``: the stage, in messages."""

    history_blocks: Callable[[], HistoryBlocks]
    walk: Callable[[NodeBlocks, Any], dict[int, np.ndarray]]
    nodes: Callable[[int], int] | None = None
    before: np.ndarray | None = None
    mapped: bool = True
    stage: str = "associate"


def searched(ctx: StageContext, seg: list[Any], meta: dict[str, Any], graph: FoundGraph, sample: np.ndarray
             ) -> tuple[NodeBlocks, dict, np.ndarray | None, tuple | None] | None:
    """:func:`found` for a segment whose rows (``sample``: its recall sample's) are past the exact prefix,
    over the saved index in ``meta``, for ``graph``'s layout and walk: the same tuple, or None where the
    task needs every row."""
    try:
        return _searched(ctx, seg, meta, graph, sample)
    except BankError as e:
        # a stored block found damaged while the recall sample's exact search read it (its name said it was
        # there): the unit gets every block instead, the damaged one gathered again (a bank that cannot give
        # the rows fails there, with the same error)
        log.warning("%s: history %s: %s; its unit gets every block", graph.stage, seg[0], e)
        return None


def _searched(ctx: StageContext, seg: list[Any], meta: dict[str, Any], graph: FoundGraph, sample: np.ndarray
              ) -> tuple[NodeBlocks, dict, np.ndarray | None, tuple | None] | None:
    a, (h, _, s1, _) = ctx.cfg.association, seg
    saved, nodes = meta["saved"], graph.nodes or (lambda s: N_GRAN * s)
    params = I.stage_params(a.ivf_nlist, a.ivf_nprobe, a.ivf_exact_nodes, meta["grid"])
    end = I.index_sessions(s1, meta["grid"])
    if meta["save"] and end > saved["sessions"] and not meta["delta"]:
        return None
    B, n = blocks.BLOCK_ROWS, nodes(s1)
    first = nodes(saved["sessions"]) // B  # the block holding the index's end
    if -(-n // B) - first > FOUND_TAIL_BLOCKS:
        return None
    hb = graph.history_blocks()
    if not hb.all_stored(first):
        return None
    tail = hb.read_blocks(first, n)
    dim = tail[first].shape[1]
    index = driver_index(ctx, saved, params, dim, graph.nodes, graph.mapped)
    if meta["delta"]:
        index.start_delta()
    walk = graph.walk(NodeBlocks([None] * first + [tail[i] for i in sorted(tail)], B, n, dim), index)
    if index.ntotal != nodes(end):
        raise RuntimeError(f"{graph.stage}: the IVF index of history {h} holds {index.ntotal} nodes after the "
                           f"walk, expected {nodes(end)} (its first {end} sessions)")
    delta = I.delta_bytes(index) if meta["delta"] else None
    del index
    need = I.found_before(walk, first * B)
    exact, taken = None, None
    if sample.size:
        E, taken = hb.streamed(n, tail, need)
        with one_blas_thread():  # the bits of a task's exact search (kernels/backend.py)
            exact = (sample, *I.sample_exact(E, sample, a.mem_threshold, graph.before))
        del E
    shipped_nodes = hb.sparse_nodes(n, tail, need, taken)
    if shipped_nodes is None:
        return None
    log.info("%s: history %s: %d of the %d node rows before row %d shipped (those found), %d blocks "
             "whole, %d rows of the recall sample searched exactly here", graph.stage, h, need.size, first * B,
             first * B, len(tail), sample.size)
    ivf_run(ctx).found_units += 1
    return shipped_nodes, walk, delta, exact


def driver_index(ctx: StageContext, saved: dict[str, Any], params: Any, dim: int,
                 nodes: Callable[[int], int] | None = None, mapped: bool = True) -> Any:
    """The saved index for :func:`found`'s walk: its full index mapped from a copy of its part
    (:mod:`memgas.jobs.history_index.ivf_mapped`) with the deltas after it in memory
    (:meth:`~memgas.pipeline.association.ivf_search.CausalIVF.stacked`), or, where no copy can be had or
    ``mapped`` is False, read from the part and loaded (:func:`loaded_index`): the same walk either way.
    ``nodes`` as :func:`loaded_index`'s."""
    run, key = ivf_run(ctx), (saved["part"], saved["history"])
    if not mapped:
        return loaded_index({**saved, "bytes": full_bytes(ctx, saved)}, params, dim, nodes)
    if key not in run.mapped:
        run.mapped[key] = ivf_mapped.mapped_copy(ctx.bank, *key, lambda: full_bytes(ctx, saved))
    if run.mapped[key] is None:
        return loaded_index({**saved, "bytes": full_bytes(ctx, saved)}, params, dim, nodes)
    base = raw_from_file(run.mapped[key], d=dim, ntotal=(nodes or (lambda s: N_GRAN * s))(saved["full_sessions"]))
    return with_deltas(I.CausalIVF.stacked(base, params), saved, dim, nodes)


# -- the task ------------------------------------------------------------------------------------------
def loaded_index(saved: dict[str, Any], params: Any, dim: int, nodes: Callable[[int], int] | None = None) -> Any:
    """The saved index (a :class:`~memgas.pipeline.association.ivf_search.CausalIVF`) with its deltas merged
    in order, from :func:`~memgas.jobs.history_index.ivf_store.saved_index`'s bytes (a reference the
    executor shared under Ray). ``nodes``: the nodes of a history's first ``s`` sessions, what each part
    must hold (None: four a session; memgas-cards' graph gives its own)."""
    nodes = nodes or (lambda s: N_GRAN * s)
    data = executor.fetch(saved["bytes"])
    index = I.index_from_bytes(data, params, d=dim, ntotal=nodes(saved.get("full_sessions", saved["sessions"])))
    del data
    return with_deltas(index, saved, dim, nodes)


def with_deltas(index: Any, saved: dict[str, Any], dim: int, nodes: Callable[[int], int] | None = None) -> Any:
    """``index`` (a :class:`~memgas.pipeline.association.ivf_search.CausalIVF` of the saved full index) with
    ``saved``'s deltas merged in order; ``nodes`` as in :func:`loaded_index`."""
    nodes = nodes or (lambda s: N_GRAN * s)
    for delta in saved.get("deltas", []):
        index.merge_delta(I.raw_from_bytes(delta["bytes"], d=dim, ntotal=nodes(delta["sessions"]) - nodes(delta["base"])))
    return index


def segment_candidates(E: Any, seg: list[Any], meta: dict[str, Any], a: dict[str, Any], out: dict[str, list],
                       recall_rows: int | None = None, found: dict | None = None) -> Any:
    """One segment under the IVF search: its candidates; its index (to save, when it is the history's
    last segment) and recall rows (its IVF rows of the ``recall_rows`` smallest row keys, None:
    :data:`~memgas.pipeline.association.ivf_search.RECALL_ROWS`) go to ``out``. The index at the
    segment's first row is the saved one (or trained afresh on the exact prefix: the same bits), plus the
    grid blocks between its end and the segment's rows, which :func:`ivf_rows` adds on its way (coarse
    lists and add, no search)."""
    _, s0, s1, _ = seg
    saved, grid = meta["saved"], meta.get("grid") or I.STAGE_BLOCK_SESSIONS
    params = I.stage_params(a["ivf_nlist"], a["ivf_nprobe"], a["ivf_exact_nodes"], grid)
    if found is not None:  # the driver searched (found): rescore, save its delta if any
        c, _ = I.ivf_rows(E, N_GRAN * s0, N_GRAN * s1, None, mem_threshold=a["mem_threshold"],
                          min_prior_nodes=a["min_prior_nodes"], params=params, found=found)
        recall_table(E, c, seg, a, out, recall_rows, meta.get("found_exact"))
        keep_found_delta(out, meta, seg, E.shape[1])
        return c
    index = None
    if saved is not None:
        index = loaded_index(saved, params, E.shape[1])
        if meta.get("delta"):
            index.start_delta()
    c, index = I.ivf_rows(E, N_GRAN * s0, N_GRAN * s1, index, mem_threshold=a["mem_threshold"],
                          min_prior_nodes=a["min_prior_nodes"], params=params, found=found)
    recall_table(E, c, seg, a, out, recall_rows)
    keep_index(out, index, meta, seg, E.shape[1])
    return c  # the faiss index is freed here: only its bytes stay, until the table is written


def keep_found_delta(out: dict[str, list], meta: dict[str, Any], seg: list[Any], dim: int) -> None:
    """The delta the driver's walk made (:func:`found`, shipped by :func:`shipped`) into ``out``, when the
    segment saves one: the task that rescores what its rows found has no index of its own to save."""
    if meta.get("found_delta") is None:
        return
    h, _, s1, _ = seg
    out["delta"].append({"history_id": h, "end_session": s1,
                         "sessions": I.index_sessions(s1, meta.get("grid") or I.STAGE_BLOCK_SESSIONS),
                         "prefix_digest": meta["digest"], "dim": dim, "base_sessions": meta["base_sessions"],
                         "index": meta["found_delta"]})


def keep_index(out: dict[str, list], index: Any, meta: dict[str, Any], seg: list[Any], dim: int,
               nodes: Callable[[int], int] | None = None) -> None:
    """The index a segment's walk left (None or untrained: none) into ``out`` when the segment saves it (the
    history's last): whole, or as the delta over the saved index it started from (``meta``, as
    :func:`segment_indexes` gives it), or nothing where it completed no grid block since (the saved index
    and its deltas stay current). It must hold the sessions of the complete grid blocks before the
    segment's end; ``nodes`` as :func:`loaded_index`'s."""
    if not meta.get("save", True) or index is None or index.index is None:
        return
    h, _, s1, _ = seg
    saved, sessions = meta["saved"], I.index_sessions(s1, meta.get("grid") or I.STAGE_BLOCK_SESSIONS)
    if index.ntotal != (nodes or (lambda s: N_GRAN * s))(sessions):
        raise RuntimeError(f"the IVF index of history {h} holds {index.ntotal} nodes, expected those of its "
                           f"first {sessions} sessions")
    row = {"history_id": h, "end_session": s1, "sessions": sessions, "prefix_digest": meta["digest"], "dim": dim}
    if saved is not None and sessions == saved["sessions"]:
        pass  # no grid block was completed: the saved index (and its deltas) stays the current one
    elif index.delta is not None:
        out["delta"].append({**row, "base_sessions": saved["sessions"], "index": I.delta_bytes(index)})
    else:
        out["index"].append({**row, "index": I.index_bytes(index)})


def recall_table(E: Any, c: Any, seg: list[Any], a: dict[str, Any], out: dict[str, list],
                 recall_rows: int | None, exact: tuple | None = None) -> None:
    """The segment's rows of the recall sample, checked against the exact search, into ``out``. ``exact``:
    the driver's ``(sample, cand, valid)`` (:func:`found`), which must be this sample."""
    h, s0, s1, _ = seg
    approx = c.rows[c.rows >= a["ivf_exact_nodes"]]
    sample, keys = I.recall_sample(h, approx, I.RECALL_ROWS if recall_rows is None else recall_rows,
                                   first_row=I.first_ivf_row(a["ivf_exact_nodes"], a["min_prior_nodes"]))
    if exact is not None and not np.array_equal(exact[0], sample):
        raise RuntimeError(f"associate: the recall sample searched on the driver ({exact[0].size} rows) is not "
                           f"the segment's ({sample.size} rows) for history {h}")
    hits, total = I.candidate_hits(E, c, sample, a["mem_threshold"], exact=None if exact is None else exact[1:])
    n = sample.size
    out["recall"].append(pa.table([[h] * n, [s0] * n, [s1] * n, sample, keys, hits, total], schema=IVF_RECALL))


# -- the report -----------------------------------------------------------------------------------------
def ivf_recall(ctx: StageContext, table: str = "ivf_recall", stage: str = "associate") -> dict[str, Any]:
    """The candidate recall of the current IVF segments (empty under the exact search or when no history
    reached the exact prefix's end): what metrics.json and report.md say the approximation costs.

    Per history, its sample is the :data:`~memgas.pipeline.association.ivf_search.RECALL_ROWS` smallest
    row keys among the rows its current segments stored (each unit stored its own smallest): the same rows,
    hence the same counts, whether the history was built at once, in several units or by appends.
    ``table``, ``stage``: the recall rows and their writer (memgas-cards': ``card_graph_ivf_recall``,
    card-graph-associate)."""
    if ctx.cfg.association.search != "ivf" or ctx.fingerprints.get(stage) in (None, "disabled"):
        return {}
    parts = tables.current_parts(ctx, table)
    if not parts:
        return {}
    t = ctx.bank.read(table, ["history_id", "key", "hits", "total"], parts=parts)
    hist = np.asarray(t["history_id"].to_pylist(), dtype=object)
    keep = I.history_sample(hist, t["key"].to_numpy(), I.RECALL_ROWS)
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
