"""card-graph-rank: memgas-cards' rankings, per shard of histories (router over five granularities, seeds,
PPR over the card graph's edges)."""

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
