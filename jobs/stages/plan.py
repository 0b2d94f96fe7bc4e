"""The plan stage: a JustMem access plan per question."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs import keys, tables
from memgas.jobs.models import JustMemModel
from memgas.jobs.stage import Active, Stage, StageContext
from memgas.jobs.stages.justmem import current_plans, justmem_enabled, justmem_model
from memgas.jobs.units import chunk

PLANS = tables.Table("plans", "fingerprint")


class PlanStage(Stage):
    """A JustMem access plan per question (``plan_queries``; LLM-free by default).

    On the index side, in the bank: Compose retrieves with the plans' rewrites, which the JustMem encoder
    embeds, so plans exist before the cards are ranked (the ranker runs no encoder). Plans are per query_id,
    which is the dataset's name, not content: a per-fingerprint table (the fingerprint hashes the questions).
    """

    name = "plan"
    reads = ("queries",)
    writes = (PLANS,)
    fields = keys.PLANNER_FIELDS
    where = "actor"
    model = "justmem"

    def active(self, ctx: StageContext) -> Active | None:
        if not justmem_enabled(ctx.cfg):
            return None
        fields, resolved = keys.planner_identity(ctx)
        cfg = ctx.cfg
        return Active(fields=fields, resolved=resolved,
                      params={"key": keys.plan_key(ctx), "temperature": cfg.llm.temperature, "seed": cfg.seed},
                      model=justmem_model(ctx, keys.planner_uses_llm(cfg)))

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        ids = sorted(ctx.bank.read("queries", ["query_id"])["query_id"].to_pylist())
        # an LLM's padded batch can change its outputs (llm.batch_size is declared); the LLM-free planner plans
        # each question alone, so its units follow the runtime-only ray.generate_unit
        size = ctx.cfg.llm.batch_size if keys.planner_uses_llm(ctx.cfg) else ctx.cfg.ray.generate_unit
        return [{"size": len(b), "queries": b} for b in chunk(ids, size)]

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        q = ctx.bank.read("queries", ["query_id", "question", "question_date_raw"],
                          filter=pc.field("query_id").isin(unit["queries"])).to_pylist()
        by_id = {r["query_id"]: r for r in q}
        return {"queries": [[i, by_id[i]["question"], by_id[i]["question_date_raw"]] for i in unit["queries"]]}

    @staticmethod
    def run(model: JustMemModel, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.justmem.plan import plan_queries

        return {"plans": plan_queries([tuple(q) for q in payload["queries"]], model.cfg, key=params["key"],
                                      llm=model.llm, temperature=params["temperature"], seed=params["seed"])}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        mine = current_plans(ctx)
        profiles = mine["profile"].to_pylist()
        return {"rows": mine.num_rows, "profiles": {p: profiles.count(p) for p in sorted(set(profiles))},
                "prompt_tokens": int(pc.sum(mine["prompt_tokens"]).as_py() or 0),
                "completion_tokens": int(pc.sum(mine["completion_tokens"]).as_py() or 0),
                "fallbacks": int(pc.sum(pc.is_valid(mine["fallback"])).as_py() or 0)}
