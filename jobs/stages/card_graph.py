"""memgas-cards' stages: JustMem's cards as a fifth MemGAS granularity, in a graph of its own.

Why separate stages and tables, not a fifth granularity in ``nodes``, ``edges`` and ``rank``: the four-granularity
graph is what every MemGAS method reads; had it held the cards, a ``justmem.*`` change that alters the cards would
re-run plain MemGAS's association and rank, and selecting memgas-cards would change plain MemGAS's
fingerprints and bytes. Here the card graph reads MemGAS's nodes and vectors and JustMem's cards, and nothing of
MemGAS's reads it back:

- ``card-graph-encode``: the cards' vectors under the one encoder key (rows of ``embeddings`` shared by content
  with card-encode and encode: a card text either encoder embedded is not embedded again);
- ``card-graph-associate``: per history, the GMM edges of the five-granularity graph
  (:mod:`memgas.pipeline.card_graph`), a per-fingerprint table (no segments: an append re-associates the
  histories of the changed dataset, unlike MemGAS's segmented edges);
- ``card-graph-rank``: memgas-cards' rankings (rows of ``rankings``).

They exist only while memgas-cards is in ``retrieval.methods`` (it has no reader yet: ``reading.methods`` refuses
it). The cards stage runs for it too; JustMem's planner and card ranker do not.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs import keys, tables
from memgas.jobs.stage import Active, Stage, StageContext
from memgas.jobs.stages.encode import embed, needed_inputs, needed_stats, plan_needed, vector_rows, vector_rows_digest
from memgas.jobs.stages.justmem import current_cards
from memgas.jobs.stages.rank import family_methods, family_ranker_active, query_vectors, ranking_rows
from memgas.jobs.stages.shards import kernel_active, matrix_loader, node_matrix, shard_units
from memgas.kernels.backend import one_blas_thread
from memgas.pipeline.config import MemgasConfig

FAMILY = "memgas-cards"


def card_graph_enabled(cfg: MemgasConfig) -> bool:
    """The card graph's stages run only when memgas-cards is ranked."""
    from memgas.pipeline.methods import uses_card_graph

    return uses_card_graph(cfg.retrieval.methods)


def _bank_cards(ctx: StageContext) -> pa.Table:
    """This config's cards of the bank's sessions (as the cards stage commits them)."""
    sessions = sorted(set(ctx.bank.read("sessions", ["text_hash"])["text_hash"].to_pylist()))
    return current_cards(ctx, sessions)


# -- encoding the cards ----------------------------------------------------------------------------------------
def _card_graph_vector_rows(ctx: StageContext) -> pa.Table:
    return vector_rows(ctx, CardGraphEncodeStage.needed(ctx)[0])


CARD_GRAPH_VECTORS = tables.Table("card_graph_vectors", "content", stored_in="embeddings",
                                  rows=_card_graph_vector_rows,
                                  digest=lambda ctx: vector_rows_digest(ctx, CardGraphEncodeStage.needed(ctx)[0]))


class CardGraphEncodeStage(Stage):
    """Embed this config's card texts under the main encoder key (what another encoder stage embedded is
    reused: rows are keyed by text and encoder)."""

    name = "card-graph-encode"
    version = "1"
    reads = ("cards", "sessions")  # the cards of the bank's sessions
    writes = (CARD_GRAPH_VECTORS,)
    fields = keys.ENCODER_OUTPUT_FIELDS
    where = "actor"
    model = "encoder"

    def active(self, ctx: StageContext) -> Active | None:
        if not card_graph_enabled(ctx.cfg):
            return None
        fields, resolved = keys.encoder_identity(ctx)
        return Active(fields=fields, resolved=resolved, model={"encoder": keys.encoder_config(ctx)})

    @staticmethod
    def needed(ctx: StageContext) -> tuple[dict[str, list[str]], dict[str, str]]:
        cards = _bank_cards(ctx)
        texts = dict(zip(cards["text_hash"].to_pylist(), cards["text"].to_pylist()))
        return {keys.encoder_key(ctx): sorted(texts)}, texts

    plan, inputs, finish, run = plan_needed, needed_inputs, needed_stats, staticmethod(embed)


def histories(ctx: StageContext) -> list[dict[str, Any]]:
    """Units of ``ray.shard_size`` of the dataset's histories."""
    return shard_units(ctx, ctx.bank.read("histories", columns=["history_id"])["history_id"].to_pylist())


# -- one history's five-granularity graph ----------------------------------------------------------------------
def card_graphs(ctx: StageContext, history_ids: list[str]) -> dict[str, tuple[Any, list[str]]]:
    """{history: (CardGraph, session ids in position order)} of ``history_ids`` that have nodes."""
    from memgas.pipeline.card_graph import build_card_graph
    from memgas.pipeline.justmem.retrieve import HistoryCards

    loader = matrix_loader(ctx, history_ids)
    sess = loader.nodes.filter(pc.field("granularity") == "session")
    hashes: dict[str, list[str]] = {}
    for h, t in zip(sess["history_id"].to_pylist(), sess["text_hash"].to_pylist()):  # sorted by position
        hashes.setdefault(h, []).append(t)
    cards = current_cards(ctx, sorted({t for ts in hashes.values() for t in ts}))
    texts = sorted(set(cards["text"].to_pylist()))
    key = keys.encoder_key(ctx)
    vecs = query_vectors(ctx.bank, texts, key) if texts else np.zeros((0, 0), np.float32)
    by_text = dict(zip(texts, vecs))
    vectors = {th: by_text[t] for th, t in zip(cards["text_hash"].to_pylist(), cards["text"].to_pylist())}
    out = {}
    for h in sorted(hashes):
        m = loader.get(h)
        hc = HistoryCards.from_table(hashes[h], cards.filter(pc.field("session_hash").isin(sorted(set(hashes[h])))),
                                     vectors)
        card_vecs = hc.vectors if len(hc.texts) else np.zeros((0, loader.dim), np.float32)
        out[h] = (build_card_graph(node_matrix(m), hc.session_pos, card_vecs), m["session_ids"])
    return out


def history_card_graph(ctx: StageContext, history_ids: list[str] | None = None) -> list[tuple]:
    """(history, CardGraph, session ids, query ids, query vectors [Q, d]) per history with questions, queries
    in id order (a history's questions are ranked as one batch: the same bits whatever the files' order)."""
    bank = ctx.bank
    filt = None if history_ids is None else pc.field("history_id").isin(history_ids)
    queries = bank.read("queries", ["query_id", "history_id", "question"], filter=filt).sort_by("query_id")
    if queries.num_rows == 0:
        return []
    qdf = queries.to_pandas()
    ids = sorted(set(qdf["history_id"]))
    graphs = card_graphs(ctx, ids)
    qv = query_vectors(bank, qdf["question"].tolist(), keys.encoder_key(ctx))
    out = []
    for h, g in qdf.groupby("history_id", sort=True):
        if h in graphs:
            graph, sids = graphs[h]
            out.append((h, graph, sids, g["query_id"].tolist(), qv[g.index.to_numpy()]))
    return out


# -- association ------------------------------------------------------------------------------------------------
CARD_GRAPH_EDGES = tables.Table("card_graph_edges", "fingerprint")


class CardGraphAssociateStage(Stage):
    """Per shard of histories: the GMM association edges of each history's five-granularity graph (one batched
    GMM fit per unit, as the associate stage)."""

    name = "card-graph-associate"
    reads = ("nodes", "node_vectors", "pairs", "cards", "card_graph_vectors", "histories")
    writes = (CARD_GRAPH_EDGES,)
    fields = ("association.mem_threshold", "association.min_prior_nodes", "retrieval.device")

    def active(self, ctx: StageContext) -> Active | None:
        if not card_graph_enabled(ctx.cfg):
            return None
        active = kernel_active(ctx)
        a = ctx.cfg.association
        active.params.update(mem_threshold=a.mem_threshold, min_prior_nodes=a.min_prior_nodes)
        return active

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        return histories(ctx)

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        graphs = card_graphs(ctx, unit["histories"])
        return {"histories": [{"history_id": h, "graph": g.to_arrays()} for h, (g, _) in graphs.items()]}

    @staticmethod
    def run(model: None, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.association.edges import edges_from
        from memgas.pipeline.card_graph import CardGraph, card_graph_candidates
        from memgas.pipeline.schema import EDGES

        hs = payload["histories"]
        with one_blas_thread():
            cands = [card_graph_candidates(CardGraph.from_arrays(h["graph"]), mem_threshold=params["mem_threshold"],
                                           min_prior_nodes=params["min_prior_nodes"], device=params["device"])
                     for h in hs]
            edges = edges_from(cands, "gmm", None, params["device"])
        cols: dict[str, list] = {"history_id": [], "src": [], "dst": [], "similarity": [], "mode": []}
        for h, e in zip(hs, edges):
            n = len(e.src)
            cols["history_id"] += [h["history_id"]] * n
            cols["src"] += e.src.tolist()
            cols["dst"] += e.dst.tolist()
            cols["similarity"] += e.sim.tolist()
            cols["mode"] += ["gmm"] * n
        return {"card_graph_edges": pa.table(cols, schema=EDGES)}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        return {"edges_gmm": tables.read_current(ctx, "card_graph_edges", columns=["src"]).num_rows}


# -- ranking ------------------------------------------------------------------------------------------------------
CARD_GRAPH_RANKINGS = tables.Table("card_graph_rankings", "fingerprint", "results", stored_in="rankings",
                                   ranks=FAMILY)


class CardGraphRankStage(Stage):
    """Per shard of histories: every query ranked by memgas-cards (router over five granularities, seeds, PPR
    over the card graph's edges)."""

    name = "card-graph-rank"
    version = "2"  # the exact PPR converges per question (kernels/ppr.py): other bits than version 1
    reads = ("queries", "nodes", "node_vectors", "pairs", "cards", "card_graph_vectors", "card_graph_edges",
             "histories")
    writes = (CARD_GRAPH_RANKINGS,)
    fields = ("retrieval.methods", "retrieval.num_seeds", "retrieval.damping", "retrieval.temp", "retrieval.router",
              "retrieval.card_graph_entropy", "retrieval.ppr", "retrieval.ppr_epsilon", "retrieval.store_top",
              "retrieval.device")

    def active(self, ctx: StageContext) -> Active | None:
        methods = family_methods(ctx.cfg.retrieval.methods, FAMILY)
        if not methods:
            return None
        return family_ranker_active(kernel_active(ctx), self.fields, ctx, methods)

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        return histories(ctx)

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        ids = unit["histories"]
        rows = history_card_graph(ctx, ids)
        edges = tables.read_current(ctx, "card_graph_edges", filter=pc.field("history_id").isin(ids),
                                    columns=["history_id", "src", "dst"]).to_pandas()
        by_h = {h: (g["src"].to_numpy(np.int64), g["dst"].to_numpy(np.int64)) for h, g in edges.groupby("history_id")}
        empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        return {"histories": [{"graph": g.to_arrays(), "session_ids": sids, "query_ids": qids, "queries": qv,
                               "edges": by_h.get(h, empty)} for h, g, sids, qids, qv in rows]}

    @staticmethod
    def run(model: None, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.card_graph import CardGraph, rank_card_graph
        from memgas.pipeline.schema import RANKINGS as SCHEMA

        r = params["retrieval"]
        cols: dict[str, list] = {"method": [], "query_id": [], "rank": [], "session_id": [], "score": []}
        for h in payload["histories"]:
            src, dst = (np.require(a, np.int64, ["C", "A", "W", "O"]) for a in h["edges"])
            queries = np.require(h["queries"], np.float32, ["C", "A", "W", "O"])
            with one_blas_thread():
                ranked = rank_card_graph(CardGraph.from_arrays(h["graph"]), queries, src, dst,
                                         num_seeds=r["num_seeds"], damping=r["damping"], temp=r["temp"],
                                         router=r["router"], device=params["device"], ppr=r["ppr"],
                                         ppr_epsilon=r["ppr_epsilon"], entropy=r["card_graph_entropy"])
            ranking_rows(cols, h["session_ids"], h["query_ids"], {m: ranked for m in r["methods"]}, r["store_top"])
        return {"rankings": pa.table(cols, schema=SCHEMA)}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        return {"queries": ctx.bank.count("queries")}
