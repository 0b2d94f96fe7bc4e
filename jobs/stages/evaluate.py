"""The evaluate stage: retrieval and QA metrics of the run."""

from __future__ import annotations

from typing import Any

from memgas.jobs.stage import Stage, StageContext
from memgas.jobs.stages.units import parts_with_prefix, prefix_of, registered


class EvaluateStage(Stage):
    """Retrieval metrics per method (session and turn level), QA metrics and judge accuracy -> metrics."""

    name = "evaluate"
    upstream = ("ingest", "rank", "read", "judge")
    config_fields = ("evaluation.ks", "evaluation.bertscore")
    store = "results"
    always_run = True
    reports_metrics = True

    def run_driver(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.jobs.evaluate_run import evaluate_run

        parts = {
            "rankings": parts_with_prefix(ctx.results, "rankings", prefix_of(ctx, "rank")),
            "answers": parts_with_prefix(ctx.results, "answers", prefix_of(ctx, "read"))
            if ctx.cfg.reading.enabled else [],
            "judgments": parts_with_prefix(ctx.results, "judgments", prefix_of(ctx, "judge"))
            if registered("judge").enabled(ctx.cfg) else [],
        }
        metrics = evaluate_run(ctx.cfg, ctx.bank, ctx.results, parts=parts)
        return {"items": metrics.get("n_queries", 0), "metrics": metrics}
