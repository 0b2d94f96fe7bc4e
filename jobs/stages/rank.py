"""The rank stage: every query ranked by every MemGAS retrieval method (JustMem's are the card ranker's).

Node vectors, as the associate stage reads them: a history of at most one block
(:data:`memgas.pipeline.association.blocks.BLOCK_ROWS` node rows) is one matrix read with the unit's other
histories; a longer one reaches the task as :class:`~memgas.pipeline.association.blocks.NodeBlocks`, read from
the bank a block at a time and put into Ray's object store (spilled to files in-process,
:mod:`memgas.jobs.history_index`), so the driver holds one block of it at a time, never the matrix. The
task ranks from :class:`~memgas.pipeline.prepared.PreparedGraph`, which reads the blocks in order for the
similarities (one block and its float64 copy at a time) and holds the history's graph.

Peak memory per history, Q its questions, S its sessions, d the vectors' size, E its stored edges:
- driver: one node block (``BLOCK_ROWS * d * 4`` bytes, 96 MiB at d = 384) while it reads, the history's
  edges (16 bytes per stored edge, through a pandas frame), its session ids and Q query vectors; for the
  hybrid baseline, the ``[S, d]`` hybrid vectors (a quarter of the node matrix, read whole);
- task: one node block, one float64 similarity block (8,192 to 16,383 rows, ``PreparedGraph``), the graph
  (CSR: about 24 bytes per stored edge; push adds 32), and the batch's ``[Q, 4S]`` float64 arrays: about ten
  at the exact PPR's peak (similarities, node scores, reset, PPR iterates), so ``~10 * Q * 4S * 8`` bytes. On
  the host, over a history of at least ``SIM_BLOCK_ROWS`` node rows, the questions go 16 at a time
  (``PreparedGraph.rank_top``, the same bits as the whole batch, under push and, since each question's exact
  PPR converges on its own, under exact PPR too), so that term is about ten arrays of ``16 * 4S * 8`` bytes
  (0.5 GB each at 10^6 sessions), whatever Q. On a GPU the batch is a history's questions together (~64 GB
  for 200 questions at 10^6 sessions).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs import tables
from memgas.jobs.keys import encoder_key, encoder_keys
from memgas.jobs.placement import kernel_device
from memgas.jobs.stage import Active, Stage, StageContext
from memgas.jobs.history_index import READ_BATCH_ROWS, history_nodes, keep_blocks
from memgas.jobs.stages.ranked import Kept, ranked_table
from memgas.jobs.stages.shards import kernel_active, node_matrix, owned
from memgas.kernels.backend import one_blas_thread
from memgas.pipeline.association import blocks
from memgas.pipeline.bank import Bank
from memgas.pipeline.errors import BankError
from memgas.pipeline.schema import EDGE_MODES, N_GRAN


def rank_history_tables(ctx: StageContext, queries: pa.Table) -> dict[str, pa.Table]:
    """A history's questions and its nodes (the vectors and edges of a history follow from its nodes and the
    keys of the encoder and the associate stage)."""
    return {"queries": queries, "nodes": tables.read_current(ctx, "nodes")}


#: kept per history across appends (:mod:`memgas.jobs.stages.ranked`): what each part's histories were ranked
#: from, and their rankings
KEPT = Kept("ranked_histories", rank_history_tables)
RANKED = tables.Table("ranked_histories", "segmented", "results", current=KEPT.current)
RANKINGS = tables.Table("rankings", "segmented", "results", current=KEPT.current, ranks="memgas")


def family_methods(methods: list[str], family: str) -> list[str]:
    """The methods of ``methods`` scored by ``family`` ("memgas": node matrices; "justmem": cards), in order."""
    from memgas.pipeline.methods import get_method

    return [m for m in methods if get_method(m).family == family]


def query_vectors(bank: Bank, questions: list[str], key: str, batch_rows: int | None = None) -> np.ndarray:
    """``batch_rows``: read ``embeddings`` that many rows at a time (:meth:`Bank.read`; the same rows)."""
    from memgas.pipeline.encode import query_hash

    hashes = [query_hash(q) for q in questions]
    t = bank.read("embeddings", ["text_hash", "vector"], batch_rows=batch_rows,
                  filter=(pc.field("encoder") == key) & pc.field("text_hash").isin(sorted(set(hashes))))
    row = {h: i for i, h in enumerate(t["text_hash"].to_pylist())}
    missing = [q for q, h in zip(questions, hashes) if h not in row]
    if missing:
        raise BankError(f"{bank.path}: {len(missing)} questions have no embedding under {key!r} "
                        f"(first: {missing[0][:60]!r}); run `memgas index` with this config")
    d = t.schema.field("vector").type.list_size
    vecs = t["vector"].combine_chunks().flatten().to_numpy(zero_copy_only=False).reshape(-1, d)
    return vecs[[row[h] for h in hashes]].astype(np.float32)


def edges_of(bank: Bank, history_ids: list[str], parts: list[str]) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    out: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
    if not parts:
        return out
    # dedupe=False: the current parts are a chain of disjoint session segments per history, so no edge is in
    # two of them, and the de-duplication (a group-by over every edge's four key columns) was the read's whole
    # cost: at 10^6 sessions 55 M edges, ~100 s and 9 GB
    t = bank.read("edges", ["history_id", "mode", "src", "dst"], parts=parts, dedupe=False,
                  filter=pc.field("history_id").isin(history_ids))
    if not t.num_rows:
        return out
    # groups by dictionary codes and a stable sort, each group in the rows' order (not pandas: at 10^6 sessions
    # its object columns held a Python string per stored edge, tens of millions)
    hist = t["history_id"].combine_chunks().dictionary_encode()
    mode = t["mode"].combine_chunks().dictionary_encode()
    h_names, m_names = hist.dictionary.to_pylist(), mode.dictionary.to_pylist()
    key = hist.indices.to_numpy().astype(np.int64) * len(m_names) + mode.indices.to_numpy()
    del hist, mode
    order = np.argsort(key, kind="stable")
    key = key[order]
    cuts = np.flatnonzero(np.r_[True, key[1:] != key[:-1], True])
    src = t["src"].to_numpy().astype(np.int64, copy=False)[order]
    dst = t["dst"].to_numpy().astype(np.int64, copy=False)[order]
    for lo, hi in zip(cuts[:-1], cuts[1:]):  # views of the sorted arrays, one group each
        h, m = divmod(int(key[lo]), len(m_names))
        out[(h_names[h], m_names[m])] = (src[lo:hi], dst[lo:hi])
    return out


def session_ids(bank: Bank, histories: list[str]) -> dict[str, list[str]]:
    """Per history, its session ids in position order (the rows of its node matrix / 4), read in batches."""
    t = bank.read("nodes", ["history_id", "position", "session_id"], batch_rows=READ_BATCH_ROWS,
                  filter=pc.field("history_id").isin(histories) & (pc.field("granularity") == "session"))
    out: dict[str, list[str]] = {}
    for h in histories:
        r = t.filter(pc.field("history_id") == h).sort_by("position")
        pos, sid = r["position"].to_numpy(), r["session_id"].to_pylist()
        keep = np.r_[True, pos[1:] != pos[:-1]] if pos.size else np.zeros(0, bool)  # one row per position
        if pos.size:
            out[h] = [s for s, k in zip(sid, keep) if k]
    return out


def hybrid_vectors(bank: Bank, key: str, history: str) -> np.ndarray | None:
    """float32 ``[S, d]``: the hybrid node vectors of one history in position order (the hybrid baseline's
    matrix, which the node blocks do not hold), under the main encoder key as the matrix loader reads them."""
    from memgas.pipeline.granularity import MatrixLoader

    t = bank.read("nodes", ["position", "text_hash"], batch_rows=READ_BATCH_ROWS,
                  filter=(pc.field("history_id") == history) & (pc.field("granularity") == "hybrid")).sort_by("position")
    pos, hashes = t["position"].to_numpy(), t["text_hash"].to_pylist()
    hashes = [x for x, k in zip(hashes, np.r_[True, pos[1:] != pos[:-1]] if pos.size else []) if k]
    if not hashes:  # no hybrid nodes (as the matrix loader: the hybrid baseline then says what is missing)
        return None
    vecs, row = MatrixLoader._read(bank, key, set(hashes), READ_BATCH_ROWS)
    return vecs[np.fromiter((row[x] for x in hashes), np.int64, len(hashes))].astype(np.float32)


def family_ranker_active(active: Active, fields: tuple[str, ...], ctx: StageContext, methods: list[str]) -> Active:
    """A graph ranker's activity: its family's subset of retrieval.methods keys its rankings (a method of another
    family added changes nothing) and the push threshold changes nothing under the exact kernel."""
    unused = ("retrieval.methods",) + (("retrieval.ppr_epsilon",) if ctx.cfg.retrieval.ppr != "push" else ())
    active.fields = tuple(f for f in fields if f not in unused)
    active.resolved["methods"] = methods
    active.params["retrieval"] = {**ctx.cfg.retrieval.model_dump(), "methods": methods}
    return active


@dataclass
class Prepared:
    """What ranking a set of histories starts from, as the rank stage reads it (and the latency probe):
    per history its session ids; the histories longer than one node block (read a block at a time, never
    whole) and a loader of the others' node matrices; the current association edges of all of them."""

    session_ids: dict[str, list[str]]
    long: set[str]
    loader: Any
    edges: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]

    def rows(self, history: str) -> int:
        return N_GRAN * len(self.session_ids[history])

    def edges_of(self, history: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        return {mode: self.edges.get((history, mode), empty) for mode in EDGE_MODES}


def prepare(ctx: StageContext, history_ids: list[str]) -> Prepared:
    """:class:`Prepared` of ``history_ids`` (in this order)."""
    from memgas.jobs.stages.shards import matrix_loader  # at call time: a test stands in for it

    sids = session_ids(ctx.bank, history_ids)
    long = {h for h, s in sids.items() if N_GRAN * len(s) > blocks.BLOCK_ROWS}
    short = [h for h in history_ids if h not in long]
    loader = matrix_loader(ctx, short) if short else None
    return Prepared(sids, long, loader, edges_of(ctx.bank, history_ids, tables.current_parts(ctx, "edges")))


def rank_inputs(ctx: StageContext, ids: list[str]) -> dict[str, Any]:
    """A unit's payload: per history with questions, its node matrices (or blocks), edges and query vectors."""
    bank = ctx.bank
    queries = bank.read("queries", ["query_id", "history_id", "question"], filter=pc.field("history_id").isin(ids))
    # in id order, not the files' order: a history's questions are ranked as one batch, whose float
    # sums depend on the rows' order (the same data ingested in another order gives the same bits)
    queries = queries.sort_by("query_id")
    if queries.num_rows == 0:
        return {"histories": []}
    p = prepare(ctx, ids)
    keep_blocks(ctx, p.long)
    qdf = queries.to_pandas()
    qv = query_vectors(bank, qdf["question"].tolist(), encoder_key(ctx))
    hybrid = "hybrid" in family_methods(ctx.cfg.retrieval.methods, "memgas")
    out = []
    for h, g in qdf.groupby("history_id", sort=True):
        if h in p.long:  # row blocks: the driver holds one block at a time (module docstring)
            nodes = {"nodes": history_nodes(ctx, h, p.rows(h)), "session_ids": p.session_ids[h],
                     "hybrid": hybrid_vectors(bank, encoder_keys(ctx)["main"], h) if hybrid else None}
        elif p.loader is not None and h in p.loader.history_ids:
            nodes = {"matrices": p.loader.get(h)}
        else:
            continue
        out.append({"history_id": h, **nodes, "query_ids": g["query_id"].tolist(),
                    "queries": qv[g.index.to_numpy()],
                    "edges": p.edges_of(h)})
    return {"histories": out}


class RankStage(Stage):
    """Per shard of histories: every query ranked by every MemGAS method (router + seeds + batched PPR).
    The JustMem methods are the card ranker's (:class:`memgas.jobs.stages.justmem.CardRankStage`): which of
    them are selected, and their settings, change nothing here. Only the histories whose questions or nodes
    changed since the run directory's last answer are ranked (:mod:`memgas.jobs.stages.ranked`)."""

    name = "rank"
    # 3: the exact PPR converges per question (kernels/ppr.py), so its bits no longer depend on the batch;
    # 2: parts per shard of changed histories, named by config (version 1: by fingerprint)
    version = "3"
    reads = ("queries", "nodes", "node_vectors", "edges", "pairs")
    writes = (RANKED, RANKINGS)
    where = "task"
    fields = ("retrieval.methods", "retrieval.num_seeds", "retrieval.damping", "retrieval.temp", "retrieval.router",
              "retrieval.ppr", "retrieval.ppr_epsilon", "retrieval.store_top", "retrieval.device")

    def active(self, ctx: StageContext) -> Active | None:
        methods = family_methods(ctx.cfg.retrieval.methods, "memgas")
        if not methods:
            return None
        return family_ranker_active(kernel_active(ctx), self.fields, ctx, methods)

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        return KEPT.plan(self, ctx)

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        return KEPT.inputs(rank_inputs(ctx, unit["histories"]), unit)

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        return KEPT.finish(self, ctx)

    @staticmethod
    def run(model: None, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.schema import RANKINGS as SCHEMA

        r = params["retrieval"]
        cols: dict[str, list] = {"method": [], "query_id": [], "rank": [], "session_id": [], "score": []}
        with one_blas_thread():
            for h in payload["histories"]:
                sids, tops = RankStage.rank_one(h, r, params["device"])
                top_rows(cols, sids, h["query_ids"], tops)
        return {"rankings": pa.table(cols, schema=SCHEMA), "ranked_histories": ranked_table(payload)}

    @staticmethod
    def rank_one(h: dict[str, Any], r: dict[str, Any], device: str) -> tuple[list[str], dict]:
        """(session ids, {method: (order [Q, top], scores [Q, top])}): the top ``r["store_top"]`` sessions of
        the MemGAS methods ``r["methods"]`` (:meth:`PreparedGraph.rank_top`: in query chunks where the bits
        allow), from the history's node matrices or its node blocks."""
        from memgas.pipeline.prepared import PreparedGraph

        if "nodes" in h:  # NodeBlocks: every read is an owned copy
            nodes, sids, hybrid = h["nodes"], h["session_ids"], h.get("hybrid")
            hybrid = None if hybrid is None else owned(hybrid, np.float32)
        else:
            m = {k: (owned(v, np.float32) if isinstance(v, np.ndarray) else v) for k, v in h["matrices"].items()}
            nodes, sids, hybrid = node_matrix(m), m["session_ids"], m.get("hybrid")
        edges = {mode: (owned(src, np.int64), owned(dst, np.int64)) for mode, (src, dst) in h["edges"].items()}
        graph = PreparedGraph(nodes, edges, hybrid=hybrid, device=device)
        ranked = graph.rank_top(owned(h["queries"], np.float32), r["methods"], r["store_top"],
                                num_seeds=r["num_seeds"], damping=r["damping"], temp=r["temp"], router=r["router"],
                                ppr=r["ppr"], ppr_epsilon=r["ppr_epsilon"])
        return sids, {x: ranked[x] for x in r["methods"]}


def ranking_rows(cols: dict[str, list], session_ids: list[str], query_ids: list[str], ranked: dict[str, tuple],
                 store_top: int) -> None:
    """Append the top ``store_top`` of each method's ranking of each query to ``cols`` (``rankings`` columns)."""
    top = min(store_top, len(session_ids))
    top_rows(cols, session_ids, query_ids,
             {m: (order[:, :top], np.take_along_axis(scores, order[:, :top], axis=1)) for m, (order, scores) in
              ranked.items()})


def top_rows(cols: dict[str, list], session_ids: list[str], query_ids: list[str],
             tops: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Append each method's top sessions of each query to ``cols`` (``rankings`` columns): ``tops[method]`` =
    (session indices [Q, top], their scores [Q, top]), best first."""
    sids = np.asarray(session_ids, dtype=object)
    for method, (order, scores) in tops.items():
        top = order.shape[1]
        for qi, qid in enumerate(query_ids):
            cols["method"] += [method] * top
            cols["query_id"] += [qid] * top
            cols["rank"] += list(range(1, top + 1))
            cols["session_id"] += sids[order[qi]].tolist()
            cols["score"] += scores[qi].astype(float).tolist()


# -- the latency of ranking one question (metrics.json ``latency``) ----------------------------------------------
def ranking_latency(ctx: StageContext, *, n_queries: int = 30, method: str = "memgas") -> dict[str, float]:
    """Latency of ranking one query at a time (similarities, router, seeds, PPR on its history's stored graph,
    the top ``retrieval.store_top`` sessions in order: what the stage stores of a question). Each history is prepared once before the timer, as a query server holds it
    (:func:`prepared_questions`); only the per-question ranking is timed."""
    import time

    from memgas.jobs.profiling import percentiles_ms

    if method not in ctx.cfg.retrieval.methods:
        return {}
    r = ctx.cfg.retrieval
    samples = []
    for graph, qv in prepared_questions(ctx, n_queries, method, [r.ppr]):
        t0 = time.perf_counter()
        graph.rank_top(qv, [method], r.store_top, num_seeds=r.num_seeds, damping=r.damping, temp=r.temp,
                       router=r.router, ppr=r.ppr, ppr_epsilon=r.ppr_epsilon)
        samples.append(time.perf_counter() - t0)
    return percentiles_ms(samples)


def prepared_questions(ctx: StageContext, n_queries: int, method: str, ppr: list[str]) -> Iterator[tuple[Any, Any]]:
    """The bank's first ``n_queries`` questions, one at a time, each as (its history's
    :class:`~memgas.pipeline.prepared.PreparedGraph`, its query vector ``[1, d]``). Every history is prepared
    first (:func:`prepare`, as the rank stage reads it: its node matrix and the graph of ``method``'s edges,
    built for each PPR kernel of ``ppr``). A history longer than one node block is read in blocks spilled to
    files, as the rank stage reads it in-process, never whole: each question reads them through their memory
    maps (page cache), with the machine's cores (``ray.num_cpus`` if set) sharing the blocks. Questions of a
    history without nodes are skipped."""
    import os

    from memgas.jobs.history_index.node_blocks import HistoryBlocks
    from memgas.pipeline.prepared import PreparedGraph

    bank = ctx.bank
    queries = bank.read("queries", ["query_id", "history_id", "question"]).to_pandas().head(n_queries)
    if queries.empty:
        return
    hids = sorted(set(queries["history_id"]))
    p = prepare(ctx, hids)
    device = kernel_device(ctx, ctx.cfg.retrieval.device)
    # a query server's cores share each question's scan of the node rows (the same bits with any number);
    # the job's Ray tasks are done by now
    threads = ctx.cfg.ray.num_cpus or len(os.sched_getaffinity(0))
    graphs = {}
    for h in hids:
        if h in p.long:  # row blocks spilled to files (they live as long as the graph's NodeBlocks)
            nodes = HistoryBlocks(ctx, h, blocks.BLOCK_ROWS, use_ray=False).nodes(p.rows(h))
        elif p.loader is not None and h in p.loader.history_ids:
            nodes = node_matrix(p.loader.get(h))
        else:
            continue
        graphs[h] = PreparedGraph(nodes, p.edges_of(h), device=device, scan_threads=threads)
        for kind in ppr:
            graphs[h].prepare([method], ppr=kind)
    del p  # the loader's vectors: the prepared graphs hold the node matrices
    qv = query_vectors(bank, queries["question"].tolist(), encoder_key(ctx))
    for i, q in enumerate(queries.itertuples(index=False)):
        if q.history_id in graphs:
            yield graphs[q.history_id], qv[i : i + 1]
