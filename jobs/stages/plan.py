"""The plan stage: a JustMem access plan per question."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs.stage import StageContext
from memgas.jobs.stages.fields import LLM_OUTPUT_FIELDS, present_fields
from memgas.jobs.stages.justmem import JustMemActorStage, current_plans
from memgas.jobs.stages.keys import plan_key
from memgas.jobs.stages.models import JustMemModel
from memgas.jobs.stages.units import chunk, drop_other_parts
from memgas.pipeline.config import MemgasConfig


class PlanStage(JustMemActorStage):
    """A JustMem access plan per question (``plan_queries``; LLM-free by default).

    On the index side, in the bank, beside the question vectors: Compose retrieves with the plans' rewrites,
    which the encode stage embeds as it embeds the questions, so plans must exist before encode (the rank
    stage runs no encoder). Plans are per query_id, which is the dataset's name, not content: the rows live in
    this stage's own parts (``plan-<fingerprint>-...``, the fingerprint hashes the dataset) and other
    fingerprints' parts are dropped once the new ones are complete, as for the associate stage's edges.
    """

    name = "plan"
    upstream = ("ingest",)
    config_fields = ("justmem.planner", "justmem.rewrites", "justmem.plan_max_tokens", *LLM_OUTPUT_FIELDS)
    check_table = "plans"
    outputs = ("plans",)
    part_prefix = "plan"

    def uses_llm(self, cfg: MemgasConfig) -> bool:
        return cfg.justmem.planner == "llm"

    def active_fields(self, cfg: MemgasConfig) -> tuple[str, ...]:
        own = ["justmem.planner", "justmem.rewrites"]
        if self.uses_llm(cfg):
            own += ["justmem.plan_max_tokens", *LLM_OUTPUT_FIELDS]
        return present_fields(cfg, tuple(own))

    def resolved_inputs(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.pipeline.justmem.plan import LLM_FREE_PLANNER
        from memgas.pipeline.prompts import JUSTMEM_PLAN_PROMPT_DIGEST

        if not self.uses_llm(ctx.cfg):
            return {"llm_free": LLM_FREE_PLANNER}
        return self._llm_resolved(ctx, JUSTMEM_PLAN_PROMPT_DIGEST)

    def key(self, ctx: StageContext) -> str:
        return plan_key(ctx)

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        ids = sorted(ctx.bank.read("queries", ["query_id"])["query_id"].to_pylist())
        # an LLM's padded batch can change its outputs (llm.batch_size is declared); the LLM-free planner plans
        # each question alone, so its units follow the runtime-only ray.generate_unit
        size = ctx.cfg.llm.batch_size if self.uses_llm(ctx.cfg) else ctx.cfg.ray.generate_unit
        return [{"part": f"{self.prefix(ctx)}{i:05d}", "size": len(b), "queries": b}
                for i, b in enumerate(chunk(ids, size))]

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
        dropped = drop_other_parts(ctx.bank, "plans", self.prefix(ctx))
        mine = current_plans(ctx)
        profiles = mine["profile"].to_pylist()
        return {"rows": mine.num_rows, "profiles": {p: profiles.count(p) for p in sorted(set(profiles))},
                "prompt_tokens": int(pc.sum(mine["prompt_tokens"]).as_py() or 0),
                "completion_tokens": int(pc.sum(mine["completion_tokens"]).as_py() or 0),
                "fallbacks": int(pc.sum(pc.is_valid(mine["fallback"])).as_py() or 0), "stale_parts_dropped": dropped}
