"""card-graph-rank: memgas-cards' rankings, per shard of histories (router over five granularities, seeds,
PPR over the card graph's edges), and the cards that ranked each question's sessions (its reader's cards)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs import tables
from memgas.jobs.stage import Active, Stage, StageContext
from memgas.jobs.stages.card_graph import FAMILY, histories, history_card_graph
from memgas.jobs.stages.rank import family_methods, family_ranker_active, ranking_rows
from memgas.jobs.stages.shards import kernel_active
from memgas.kernels.backend import one_blas_thread


# -- ranking ------------------------------------------------------------------------------------------------------
CARD_GRAPH_RANKINGS = tables.Table("card_graph_rankings", "fingerprint", "results", stored_in="rankings",
                                   ranks=FAMILY)
#: per question and stored session, its cards of most PPR mass (``pipeline.schema.CARD_GRAPH_PICKS``)
CARD_GRAPH_PICKS = tables.Table("card_graph_picks", "fingerprint", "results")


class CardGraphRankStage(Stage):
    """Per shard of histories: every query ranked by memgas-cards (router over five granularities, seeds, PPR
    over the card graph's edges), and of each of its ``retrieval.store_top`` sessions the
    ``retrieval.card_graph_picks`` cards of most PPR mass (``card_graph_picks``: what the reader shows)."""

    name = "card-graph-rank"
    #: 2: the exact PPR converges per question (kernels/ppr.py), other bits than version 1; 3: the card picks
    #: (the rankings' rows are version 2's, byte for byte)
    version = "3"
    reads = ("queries", "nodes", "node_vectors", "pairs", "cards", "card_graph_vectors", "card_graph_edges",
             "histories")
    writes = (CARD_GRAPH_RANKINGS, CARD_GRAPH_PICKS)  # the rankings' part last: it marks the unit done
    fields = ("retrieval.methods", "retrieval.num_seeds", "retrieval.damping", "retrieval.temp", "retrieval.router",
              "retrieval.card_graph_entropy", "retrieval.ppr", "retrieval.ppr_epsilon", "retrieval.store_top",
              "retrieval.card_graph_picks", "retrieval.device")

    def active(self, ctx: StageContext) -> Active | None:
        methods = family_methods(ctx.cfg.retrieval.methods, FAMILY)
        if not methods:
            return None
        return family_ranker_active(kernel_active(ctx), self.fields, ctx, methods)

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        return histories(ctx)

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        ids = unit["histories"]
        card_ids: dict[str, list[str]] = {}
        rows = history_card_graph(ctx, ids, card_ids)
        edges = tables.read_current(ctx, "card_graph_edges", filter=pc.field("history_id").isin(ids),
                                    columns=["history_id", "src", "dst"]).to_pandas()
        by_h = {h: (g["src"].to_numpy(np.int64), g["dst"].to_numpy(np.int64)) for h, g in edges.groupby("history_id")}
        empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        return {"histories": [{"graph": g.to_arrays(), "session_ids": sids, "query_ids": qids, "queries": qv,
                               "edges": by_h.get(h, empty), "card_ids": card_ids[h]}
                              for h, g, sids, qids, qv in rows]}

    @staticmethod
    def run(model: None, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.card_graph import CardGraph, card_graph_ppr
        from memgas.pipeline.schema import CARD_GRAPH_PICKS as PICKS
        from memgas.pipeline.schema import RANKINGS as SCHEMA

        r = params["retrieval"]
        cols: dict[str, list] = {"method": [], "query_id": [], "rank": [], "session_id": [], "score": []}
        picks: dict[str, list] = {c: [] for c in PICKS.names}
        for h in payload["histories"]:
            src, dst = (np.require(a, np.int64, ["C", "A", "W", "O"]) for a in h["edges"])
            queries = np.require(h["queries"], np.float32, ["C", "A", "W", "O"])
            graph = CardGraph.from_arrays(h["graph"])
            with one_blas_thread():
                order, scores, mass = card_graph_ppr(graph, queries, src, dst, num_seeds=r["num_seeds"],
                                                     damping=r["damping"], temp=r["temp"], router=r["router"],
                                                     device=params["device"], ppr=r["ppr"],
                                                     ppr_epsilon=r["ppr_epsilon"], entropy=r["card_graph_entropy"])
            ranking_rows(cols, h["session_ids"], h["query_ids"], {m: (order, scores) for m in r["methods"]},
                         r["store_top"])
            for m in r["methods"]:
                pick_rows(picks, m, graph, h, order, mass, r["store_top"], r["card_graph_picks"])
        return {"rankings": pa.table(cols, schema=SCHEMA), "card_graph_picks": pa.table(picks, schema=PICKS)}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        return {"queries": ctx.bank.count("queries"),
                "card_picks": tables.read_current(ctx, "card_graph_picks", columns=["card_id"]).num_rows}


def pick_rows(cols: dict[str, list], method: str, graph: Any, h: dict[str, Any], order: np.ndarray,
              mass: np.ndarray, store_top: int, per_session: int) -> None:
    """Append one history's ``card_graph_picks`` rows of ``method`` to ``cols``
    (:func:`memgas.pipeline.card_graph.session_card_picks` over its stored sessions)."""
    from memgas.pipeline.card_graph import CARD, session_card_picks

    top = min(store_top, graph.n_sessions)
    nodes_of_cards = np.flatnonzero(graph.gran == CARD).tolist()
    if len(nodes_of_cards) != len(h["card_ids"]):
        raise ValueError(f"{len(h['card_ids'])} card ids for the {len(nodes_of_cards)} card nodes of a history")
    card_of = dict(zip(nodes_of_cards, h["card_ids"]))
    sids = h["session_ids"]
    for qi, (ranks, nodes) in enumerate(session_card_picks(graph, order, mass, top, per_session)):
        qid, best = h["query_ids"][qi], order[qi]
        within = np.arange(len(ranks)) - np.searchsorted(ranks, ranks, side="left")
        cols["method"] += [method] * len(nodes)
        cols["query_id"] += [qid] * len(nodes)
        cols["rank"] += (ranks + 1).tolist()
        cols["session_id"] += [sids[s] for s in best[ranks].tolist()]
        cols["card_rank"] += (within + 1).tolist()
        cols["card_id"] += [card_of[n] for n in nodes.tolist()]
        cols["mass"] += mass[qi, nodes].tolist()
