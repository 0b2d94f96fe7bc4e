"""The associate stage: GMM association edges per history."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs.stage import StageContext
from memgas.jobs.stages.shards import (
    HistoryShardStage,
    matrix_loader,
    node_matrix,
    owned,
)
from memgas.jobs.stages.units import drop_other_parts
from memgas.kernels.backend import one_blas_thread


class AssociateStage(HistoryShardStage):
    """Per history: GMM association edges (and the top-k edges of the "no GMM" ablation)."""

    name = "associate"
    upstream = ("ingest", "nodes", "encode")  # node matrices: which texts (nodes) and their vectors (encode)
    config_fields = ("association.mem_threshold", "association.min_prior_nodes", "association.topk_edges",
                     "association.dense_max_nodes", "retrieval.device")
    check_table = "edges"
    outputs = ("edges",)
    part_prefix = "assoc"

    def params(self, ctx: StageContext) -> dict[str, Any]:
        return {"association": ctx.cfg.association.model_dump(), **self.resolved_inputs(ctx)}

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        loader = matrix_loader(ctx, unit["histories"])
        ids = [h for h in unit["histories"] if h in loader.history_ids]
        return {"histories": ids, "matrices": [node_matrix(loader.get(h)) for h in ids]}

    @staticmethod
    def run(model: None, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.association import associate_many
        from memgas.pipeline.schema import EDGES

        a = params["association"]
        cols: dict[str, list] = {"history_id": [], "src": [], "dst": [], "similarity": [], "mode": []}
        with one_blas_thread():
            per_mode = {mode: associate_many([owned(m, np.float32) for m in payload["matrices"]],
                                             mem_threshold=a["mem_threshold"], min_prior_nodes=a["min_prior_nodes"],
                                             mode=mode, topk_edges=a["topk_edges"], device=params["device"],
                                             dense_max_nodes=a["dense_max_nodes"])
                        for mode in ("gmm", "topk")}
        for mode, edges in per_mode.items():
            for h, e in zip(payload["histories"], edges):
                n = len(e.src)
                cols["history_id"] += [h] * n
                cols["src"] += e.src.tolist()
                cols["dst"] += e.dst.tolist()
                cols["similarity"] += e.sim.tolist()
                cols["mode"] += [mode] * n
        return {"edges": pa.table(cols, schema=EDGES)}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        prefix = self.prefix(ctx)
        dropped = drop_other_parts(ctx.bank, "edges", prefix)
        edges = ctx.bank.read("edges", ["mode"])
        return {"edges_gmm": int(pc.sum(pc.equal(edges["mode"], "gmm")).as_py() or 0),
                "edges_topk": int(pc.sum(pc.equal(edges["mode"], "topk")).as_py() or 0),
                "topk_edges": ctx.cfg.association.topk_edges, "stale_parts_dropped": dropped}
