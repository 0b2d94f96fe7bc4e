"""card-graph-associate: per history, the GMM edges of memgas-cards' five-granularity graph
(:mod:`memgas.jobs.stages.card_graph` holds the graph's loading and the stages' shared functions)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from memgas.jobs import tables
from memgas.jobs.stage import Active, Stage, StageContext
from memgas.jobs.stages.card_graph import card_graph_enabled, card_graphs, histories
from memgas.jobs.stages.shards import kernel_active
from memgas.kernels.backend import one_blas_thread


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
        # the parts' row counts (their metadata), not a read: its de-duplication over every edge of the
        # history set (8 M at 120 histories: 1.9 GB and 9 s in the driver) was the run's peak; a unit's part holds
        # its own histories' edges and the other fingerprints' parts are gone, so no edge is counted twice
        return {"edges_gmm": ctx.bank.count("card_graph_edges")}
