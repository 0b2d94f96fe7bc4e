"""The nodes stage: the node rows of every (history, session)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from memgas.jobs.keys import generation_key
from memgas.jobs.stage import Stage, StageContext
from memgas.jobs.tables import Table

NODES = Table("nodes", "fingerprint")


class NodesStage(Stage):
    """Per (history, session): the five node rows (session, turn, summary, keyword, hybrid) and their texts.
    One unit, built on the driver from the bank's sessions and this config's generations."""

    name = "nodes"
    reads = ("sessions", "generations")
    writes = (NODES,)
    where = "driver"

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.granularity import build_nodes

        model, version = generation_key(ctx)
        return {"nodes": build_nodes(ctx.bank, generator_model=model, prompt_version=version)}

    @staticmethod
    def run(model: None, payload: dict[str, pa.Table], params: dict[str, Any]) -> dict[str, pa.Table]:
        return payload

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        return {"items": ctx.bank.count("nodes")}
