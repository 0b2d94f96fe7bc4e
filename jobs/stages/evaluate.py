"""The evaluate report: retrieval and QA metrics of the run."""

from __future__ import annotations

from typing import Any

from memgas.jobs import tables
from memgas.jobs.stage import Active, Report, StageContext


class EvaluateReport(Report):
    """Retrieval metrics per method (session and turn level), QA metrics and judge accuracy -> metrics, over
    the current rows of every ranking, answer and judgment table."""

    name = "evaluate"
    reads = ("queries", "rankings", "card_rankings", "card_graph_rankings", "answers", "card_answers", "judgments")
    fields = ("evaluation.ks", "evaluation.bertscore")

    def active(self, ctx: StageContext) -> Active:
        from memgas.pipeline.methods import uses_card_graph

        # memgas-cards' rankings are read only where it is ranked: other configs keep their fingerprint
        if uses_card_graph(ctx.cfg.retrieval.methods):
            return Active()
        return Active(reads=tuple(t for t in self.reads if t != "card_graph_rankings"))

    def report(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.jobs.evaluate_run import evaluate_run

        parts = {"rankings": [*tables.current_parts(ctx, "rankings"), *tables.current_parts(ctx, "card_rankings"),
                              *tables.current_parts(ctx, "card_graph_rankings")],
                 "answers": [*tables.current_parts(ctx, "answers"), *tables.current_parts(ctx, "card_answers")],
                 "judgments": tables.current_parts(ctx, "judgments")}
        metrics = evaluate_run(ctx.cfg, ctx.bank, ctx.results, parts={k: sorted(v) for k, v in parts.items()})
        return {"items": metrics.get("n_queries", 0), "metrics": metrics}
