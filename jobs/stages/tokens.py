"""LLM tokens per retrieval method (metrics.json ``tokens``)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs.stage import StageContext
from memgas.jobs.stages.justmem import current_cards, current_plans, justmem_enabled
from memgas.jobs.stages.keys import generation_key
from memgas.jobs.stages.read import current_answers

#: JustMem methods whose retrieval reads the plans (the profile, or the rewrites): they pay the planner
PLANNED_METHODS: tuple[str, ...] = ("justmem", "justmem-compose")


#: MemGAS methods that read generated texts (summaries, keywords): they pay the generate stage
GENERATED_METHODS: tuple[str, ...] = ("summary", "keyword", "hybrid", "memgas", "memgas-no-gmm", "memgas-no-ppr",
                                      "memgas-no-router", "memgas-no-association")


def _token_sums(t: pa.Table) -> dict[str, int]:
    return {"prompt": int(pc.sum(t["prompt_tokens"]).as_py() or 0),
            "completion": int(pc.sum(t["completion_tokens"]).as_py() or 0)}


def method_tokens(ctx: StageContext) -> dict[str, dict[str, Any]]:
    """LLM tokens per retrieval method (metrics.json ``tokens``): ``construction`` = the memory it reads
    (MemGAS: this config's generations, for the methods that read summaries or keywords; JustMem: this config's
    cards), ``planner`` = this config's plans for the methods that read them (:data:`PLANNED_METHODS`),
    ``answer`` = the read stage's answers of that method (prompt includes the filter step). LLM-free
    construction and planning count 0 tokens. Over the whole bank's sessions and questions (the same for every
    method of the run), answers over the questions read."""
    from memgas.pipeline.methods import get_method

    bank, cfg = ctx.bank, ctx.cfg
    zero = {"prompt": 0, "completion": 0}
    gen = zero
    if any(m in GENERATED_METHODS for m in cfg.retrieval.methods) and bank.exists("generations"):
        model, version = generation_key(ctx)
        gen = _token_sums(bank.read("generations", ["prompt_tokens", "completion_tokens"],
                                    filter=(pc.field("model") == model) & (pc.field("prompt_version") == version)))
    cards = plans = zero
    if justmem_enabled(cfg):
        cards = _token_sums(current_cards(ctx)) if bank.exists("cards") else zero
        plans = _token_sums(current_plans(ctx))
    answers: dict[str, dict[str, int]] = {}
    if cfg.reading.enabled and ctx.results is not None:
        ans = current_answers(ctx)
        for m in set(ans["method"].to_pylist()):
            answers[m] = _token_sums(ans.filter(pc.field("method") == m))
    out = {}
    for m in cfg.retrieval.methods:
        jm = get_method(m).family == "justmem"
        construction = cards if jm else (gen if m in GENERATED_METHODS else zero)
        planner = plans if m in PLANNED_METHODS else zero
        out[m] = {"construction": construction, "planner": planner, "answer": answers.get(m, zero)}
    return out
