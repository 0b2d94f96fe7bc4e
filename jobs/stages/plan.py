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
from memgas.pipeline.errors import LLMCallsFailed

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
        # questions planned by an earlier run of this fingerprint are kept: only those whose LLM call failed
        # are planned again, in units named apart from the earlier ones (whose parts exist)
        done = set(current_plans(ctx)["query_id"].to_pylist())
        ids = sorted(q for q in ctx.bank.read("queries", ["query_id"])["query_id"].to_pylist() if q not in done)
        earlier = len(tables.current_parts(ctx, "plans"))
        tag = {"tag": f"retry{earlier}"} if earlier else {}
        # an LLM's padded batch can change its outputs (llm.batch_size is declared); the LLM-free planner plans
        # each question alone, so its units follow the runtime-only ray.generate_unit
        size = ctx.cfg.llm.batch_size if keys.planner_uses_llm(ctx.cfg) else ctx.cfg.ray.generate_unit
        return [{"size": len(b), "queries": b, **tag} for b in chunk(ids, size)]

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
        # a question without a plan row: its LLM call failed in the backend (every other outcome is a row)
        failed = ctx.bank.read("queries", ["query_id"]).num_rows - len(set(mine["query_id"].to_pylist()))
        stop = LLMCallsFailed(f"plan: {failed} questions failed in the LLM backend (no plan stored for them); "
                              "check llm.backend/llm.base_url and re-run (finished questions are kept)")
        return {"rows": mine.num_rows, "profiles": {p: profiles.count(p) for p in sorted(set(profiles))},
                "prompt_tokens": int(pc.sum(mine["prompt_tokens"]).as_py() or 0),
                "completion_tokens": int(pc.sum(mine["completion_tokens"]).as_py() or 0),
                "fallbacks": int(pc.sum(pc.is_valid(mine["fallback"])).as_py() or 0),
                "llm_failures": failed, "unfinished": failed, "stop": stop}
