"""The nodes stage: the node rows of every (history, session)."""

from __future__ import annotations

from typing import Any

from memgas.jobs.stage import Stage, StageContext
from memgas.jobs.stages.keys import generation_key


class NodesStage(Stage):
    """Per (history, session): the five node rows (session, turn, summary, keyword, hybrid) and their texts."""

    name = "nodes"
    upstream = ("ingest", "generate")
    outputs = ("nodes",)

    def run_driver(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.pipeline.granularity import build_nodes

        model, version = generation_key(ctx)
        nodes = build_nodes(ctx.bank, generator_model=model, prompt_version=version)
        ctx.bank.write("nodes", nodes, info={"fingerprint": ctx.fingerprints[self.name]})
        return {"items": nodes.num_rows}
