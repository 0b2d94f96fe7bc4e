"""The judge stage: LongMemEval's LLM judge over the run's answers."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from memgas.jobs import keys, tables
from memgas.jobs.stage import Active, Stage, StageContext
from memgas.jobs.stages.read import current_answers
from memgas.jobs.units import chunk


class JudgeStage(Stage):
    """LongMemEval's per-type LLM judge over the run's answers (every reader's); reuses the readers' engine."""

    name = "judge"
    reads = ("queries", "answers", "card_answers", "card_graph_answers")
    writes = (tables.Table("judgments", "fingerprint", "results"),)
    fields = ("evaluation.judge", *keys.LLM_OUTPUT_FIELDS)
    where = "actor"
    model = "llm"

    def active(self, ctx: StageContext) -> Active | None:
        from memgas.jobs.stages.card_graph_read import card_graph_read_enabled

        cfg = ctx.cfg
        if not (cfg.evaluation.judge and cfg.reading.enabled):
            return None
        from memgas.pipeline.evaluate.judge import JUDGE_PROMPT_DIGEST  # the evaluation's package imports pandas

        # memgas-cards' answers only while it is read: otherwise the judge keeps the fingerprint it had without them
        reads = None if card_graph_read_enabled(cfg) else tuple(t for t in self.reads if t != "card_graph_answers")
        return Active(reads=reads, resolved=keys.llm_resolved(ctx, JUDGE_PROMPT_DIGEST),
                      params={"temperature": cfg.llm.temperature, "seed": cfg.seed},
                      model={"llm": cfg.llm.model_dump(), "llm_runtime": ctx.resolved.get("llm"), "seed": cfg.seed})

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        from memgas.pipeline.read import is_failed_answer

        ans = current_answers(ctx)
        units = []
        by_method: dict[str, list[str]] = {}
        for m, q, e in zip(ans["method"].to_pylist(), ans["query_id"].to_pylist(), ans["error"].to_pylist()):
            if not is_failed_answer(e):
                by_method.setdefault(m, []).append(q)
        for m in sorted(by_method):
            for batch in chunk(sorted(by_method[m]), max(8, ctx.cfg.llm.batch_size)):
                units.append({"tag": m, "size": len(batch), "method": m, "queries": batch})
        return units

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        ans = current_answers(ctx).to_pandas()
        ans = ans[(ans["method"] == unit["method"]) & ans["query_id"].isin(unit["queries"])]
        q = ctx.bank.read("queries", ["query_id", "question", "answer", "question_type", "is_abstention"]).to_pandas()
        df = ans[["query_id", "hypothesis"]].merge(q, on="query_id").sort_values("query_id")
        df["hypothesis"] = df["hypothesis"].fillna("")
        return {"method": unit["method"], "rows": df.to_dict("records")}

    @staticmethod
    def run(model: Any, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        import pandas as pd
        from memgas.pipeline.evaluate.judge import run_judge
        from memgas.pipeline.schema import JUDGMENTS

        judged = run_judge(model, pd.DataFrame(payload["rows"]))
        rows = [{"method": payload["method"], "query_id": r["query_id"], "question_type": r["question_type"],
                 "template": r["template"], "judge_output": r["judge_output"], "label": r["label"],
                 "scored_by": r["method"], "error": r["error"]} for r in judged.to_dict("records")]
        return {"judgments": pa.Table.from_pylist(rows, schema=JUDGMENTS)}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        return {"judged": ctx.results.count("judgments")}
