"""The judge stage: LongMemEval's LLM judge over the run's answers."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from memgas.jobs.stage import Stage, StageContext
from memgas.jobs.stages.fields import LLM_OUTPUT_FIELDS
from memgas.jobs.stages.read import ReadStage, current_answers
from memgas.jobs.stages.units import chunk, drop_other_parts
from memgas.pipeline.config import MemgasConfig


class JudgeStage(Stage):
    """LongMemEval's per-type LLM judge over the run's answers; reuses the reading actor's engine."""

    name = "judge"
    upstream = ("ingest", "read")
    config_fields = ("evaluation.judge", *LLM_OUTPUT_FIELDS)
    where = "actor"
    model = "llm"
    store = "results"
    check_table = "judgments"
    outputs = ("judgments",)
    part_prefix = "judge"

    def enabled(self, cfg: MemgasConfig) -> bool:
        return cfg.evaluation.judge and cfg.reading.enabled

    model_config = ReadStage.model_config
    num_gpus = ReadStage.num_gpus

    def resolved_inputs(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.pipeline.evaluate.judge import JUDGE_PROMPT_DIGEST

        return {"llm": ctx.resolved.get("llm"), "llm_files": (ctx.resolved.get("model_files") or {}).get("llm"),
                "prompts": JUDGE_PROMPT_DIGEST}

    def params(self, ctx: StageContext) -> dict[str, Any]:
        return {"temperature": ctx.cfg.llm.temperature, "seed": ctx.cfg.seed}

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        from memgas.pipeline.read import is_failed_answer

        ans = current_answers(ctx)
        units = []
        by_method: dict[str, list[str]] = {}
        for m, q, e in zip(ans["method"].to_pylist(), ans["query_id"].to_pylist(), ans["error"].to_pylist()):
            if not is_failed_answer(e):
                by_method.setdefault(m, []).append(q)
        for m in sorted(by_method):
            for i, batch in enumerate(chunk(sorted(by_method[m]), max(8, ctx.cfg.llm.batch_size))):
                units.append({"part": f"{self.prefix(ctx)}{m}-{i:05d}", "size": len(batch), "method": m, "queries": batch})
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
        drop_other_parts(ctx.results, "judgments", self.prefix(ctx))
        return {"judged": ctx.results.count("judgments")}
