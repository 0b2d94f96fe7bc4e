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
        return {"nodes": build_nodes(ctx.bank, generator_model=model, prompt_version=version,
                                     earlier=self.earlier(ctx))}

    @staticmethod
    def earlier(ctx: StageContext) -> pa.Table | None:
        """The rows this stage committed last, when its key (code version and fields) is the same and every
        part its marker names is there with its bytes: ``build_nodes`` takes from them the hybrid hashes of
        the sessions whose inputs are unchanged, so an append reads the texts of its own sessions only. The
        rows built are the same either way (``build_nodes`` checks each session's inputs by their hashes)."""
        marker = ctx.last_marker
        parts, key = marker.get("parts"), marker.get("key")
        if key is None or key != ctx.keys.get(NodesStage.name) or not isinstance(parts, dict):
            return None
        mine = [(k.partition("/")[2], d) for k, d in parts.items() if k.startswith("nodes/")]
        if not mine or not all(ctx.bank.verify_part("nodes", p, d) for p, d in mine):
            return None
        return ctx.bank.read("nodes", ["history_id", "session_id", "granularity", "text_hash"],
                             parts=[p for p, _ in mine])

    @staticmethod
    def run(model: None, payload: dict[str, pa.Table], params: dict[str, Any]) -> dict[str, pa.Table]:
        return payload

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        return {"items": ctx.bank.count("nodes")}
