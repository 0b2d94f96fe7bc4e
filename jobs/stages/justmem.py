"""What the JustMem stages share: whether they run, their actor, and this config's cards and plans."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs.stage import Stage, StageContext
from memgas.jobs.stages.keys import cards_key
from memgas.jobs.stages.placement import llm_on_cuda, model_gpus
from memgas.jobs.stages.units import parts_with_prefix, prefix_of
from memgas.pipeline.config import MemgasConfig


def justmem_enabled(cfg: MemgasConfig) -> bool:
    """The cards and plan stages run (and encode/rank read them) only when a JustMem method is selected."""
    from memgas.pipeline.methods import uses_justmem

    return uses_justmem(cfg.retrieval.methods) or (cfg.reading.enabled and uses_justmem(cfg.reading.methods))


class JustMemActorStage(Stage):
    """Shared by cards and plan: an actor that holds an LLM only when ``uses_llm`` (else one per Ray CPU)."""

    where = "actor"
    model = "justmem"

    def enabled(self, cfg: MemgasConfig) -> bool:
        return justmem_enabled(cfg)

    def uses_llm(self, cfg: MemgasConfig) -> bool:
        raise NotImplementedError

    def fits_one_core(self, ctx: StageContext) -> bool:
        return not self.uses_llm(ctx.cfg)

    def model_config(self, ctx: StageContext) -> dict[str, Any]:
        cfg = ctx.cfg
        llm = self.uses_llm(cfg)
        return {"justmem": cfg.justmem.model_dump(), "llm": cfg.llm.model_dump(), "seed": cfg.seed, "use_llm": llm,
                "llm_runtime": ctx.resolved.get("llm") if llm else None}

    def num_gpus(self, ctx: StageContext) -> float:
        return model_gpus(ctx, self.uses_llm(ctx.cfg) and llm_on_cuda(ctx))

    def key(self, ctx: StageContext) -> str:
        """The column that keys this stage's rows (cards: ``extractor``, plans: ``planner``)."""
        raise NotImplementedError

    def params(self, ctx: StageContext) -> dict[str, Any]:
        return {"key": self.key(ctx), "temperature": ctx.cfg.llm.temperature, "seed": ctx.cfg.seed}

    def _llm_resolved(self, ctx: StageContext, prompts: str) -> dict[str, Any]:
        # fp32 CPU and bf16 GPU outputs differ: the LLM's device/dtype, files and prompt texts key the rows
        return {"llm": ctx.resolved.get("llm"), "llm_files": (ctx.resolved.get("model_files") or {}).get("llm"),
                "prompts": prompts}


def current_plans(ctx: StageContext, query_ids: list[str] | None = None) -> pa.Table:
    """The plans of the plan stage's current fingerprint (optionally of ``query_ids``)."""
    from memgas.pipeline.schema import PLANS

    parts = parts_with_prefix(ctx.bank, "plans", prefix_of(ctx, "plan"))
    if not parts:
        return PLANS.empty_table()
    return ctx.bank.read("plans", parts=parts,
                         filter=None if query_ids is None else pc.field("query_id").isin(query_ids))


def plan_profiles(ctx: StageContext) -> dict[str, dict[str, int]]:
    """{question type: {profile: questions}} of this config's plans (empty without a JustMem method): how
    the planner's access profiles fall over the dataset's question types (metrics.json ``profiles``)."""
    if not justmem_enabled(ctx.cfg):
        return {}
    plans = current_plans(ctx).select(["query_id", "profile"]).to_pylist()
    types = ctx.bank.read("queries", ["query_id", "question_type"]).to_pylist()
    qtype = {r["query_id"]: r["question_type"] or "unknown" for r in types}
    out: dict[str, dict[str, int]] = {}
    for p in sorted(plans, key=lambda r: r["query_id"]):
        by = out.setdefault(qtype.get(p["query_id"], "unknown"), {})
        by[p["profile"]] = by.get(p["profile"], 0) + 1
    return {t: dict(sorted(v.items())) for t, v in sorted(out.items())}


def justmem_text_groups(ctx: StageContext) -> dict[str, set[str]]:
    """{"card": text hashes, "plan rewrite": text hashes} of this config's JustMem texts (empty without a
    JustMem method): the groups the encoding accounting adds (encoded under the main key)."""
    from memgas.pipeline.hashing import text_hash

    if not justmem_enabled(ctx.cfg):
        return {}
    rewrites = {text_hash(r) for rs in current_plans(ctx)["rewrites"].to_pylist() for r in rs or []}
    return {"card": set(current_cards(ctx)["text_hash"].to_pylist()), "plan rewrite": rewrites}


def current_cards(ctx: StageContext, session_hashes: list[str] | None = None) -> pa.Table:
    """This config's cards (optionally of ``session_hashes``)."""
    f = pc.field("extractor") == cards_key(ctx)
    if session_hashes is not None:
        f = f & pc.field("session_hash").isin(session_hashes)
    return ctx.bank.read("cards", filter=f)


def justmem_texts(ctx: StageContext) -> dict[str, str]:
    """{text_hash: text} of this config's card texts and plan rewrites (encoded under the main key)."""
    from memgas.pipeline.hashing import text_hash

    if not justmem_enabled(ctx.cfg):
        return {}
    cards = current_cards(ctx)
    out = dict(zip(cards["text_hash"].to_pylist(), cards["text"].to_pylist()))
    for rewrites in current_plans(ctx)["rewrites"].to_pylist():
        for r in rewrites or []:
            out[text_hash(r)] = r
    return out
