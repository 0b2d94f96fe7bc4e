"""The read stage: answers from the top-ranked sessions (or a JustMem reader's cards)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs.stage import Stage, StageContext
from memgas.jobs.stages.fields import LLM_OUTPUT_FIELDS
from memgas.jobs.stages.keys import generation_key, plan_key
from memgas.jobs.stages.placement import llm_on_cuda, model_gpus
from memgas.jobs.stages.units import (
    attempt_of,
    chunk,
    drop_other_parts,
    parts_with_prefix,
    prefix_of,
)
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.errors import BankError

READ_FIELDS = ("reading.enabled", "reading.methods", "reading.top_k", "reading.filter", "reading.max_questions",
               "reading.context_tokens", "reading.max_new_tokens")


class ReadStage(Stage):
    """Filter the top-K retrieved sessions, then answer (one LLM actor, batched across queries).

    JustMem methods that read cards (``methods.reads_cards``) answer from the rank stage's ``card_picks``
    instead (:mod:`memgas.pipeline.justmem.read`: cards with their dates, the planner's operation, Replay's
    source turns within ``justmem.replay_tokens``). Answers that failed in the LLM backend (after the
    client's own retries) are kept out of the QA metrics, counted, and re-planned on the next run; the stage
    is complete only when none is left.
    """

    name = "read"
    upstream = ("ingest", "generate", "rank")
    config_fields = (*READ_FIELDS, *LLM_OUTPUT_FIELDS, "justmem.replay_tokens")
    where = "actor"
    model = "llm"
    store = "results"
    check_table = "answers"
    outputs = ("answers",)
    part_prefix = "ans"
    failure_stat = "failed"
    run_info_stats = {"answered": "answers"}

    def enabled(self, cfg: MemgasConfig) -> bool:
        return cfg.reading.enabled

    @staticmethod
    def reads_cards(cfg: MemgasConfig) -> bool:
        from memgas.pipeline.methods import reads_cards

        return any(reads_cards(m) for m in cfg.reading.methods)

    def active_fields(self, cfg: MemgasConfig) -> tuple[str, ...]:
        # justmem.replay_tokens shapes only the JustMem answer prompt: without a card reader it changes nothing
        return self.config_fields if self.reads_cards(cfg) else tuple(f for f in self.config_fields
                                                                       if not f.startswith("justmem."))

    def model_config(self, ctx: StageContext) -> dict[str, Any]:
        return {"llm": ctx.cfg.llm.model_dump(), "llm_runtime": ctx.resolved.get("llm"), "seed": ctx.cfg.seed}

    def resolved_inputs(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.pipeline.prompts import (
            JUSTMEM_READ_PROMPT_DIGEST,
            READING_PROMPT_DIGEST,
        )

        out = {"llm": ctx.resolved.get("llm"), "llm_files": (ctx.resolved.get("model_files") or {}).get("llm"),
               "prompts": READING_PROMPT_DIGEST}
        if self.reads_cards(ctx.cfg):  # the JustMem answer prompt, and the planner whose operation it carries
            out["justmem_prompts"] = JUSTMEM_READ_PROMPT_DIGEST
            out["planner"] = plan_key(ctx)
        return out

    def num_gpus(self, ctx: StageContext) -> float:
        return model_gpus(ctx, llm_on_cuda(ctx))

    def params(self, ctx: StageContext) -> dict[str, Any]:
        return {"reading": ctx.cfg.reading.model_dump(), "temperature": ctx.cfg.llm.temperature, "seed": ctx.cfg.seed,
                "replay_tokens": ctx.cfg.justmem.replay_tokens}

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        from memgas.pipeline.read import is_failed_answer

        cfg = ctx.cfg
        queries = ctx.bank.read("queries", ["query_id"])["query_id"].to_pylist()
        if cfg.reading.max_questions is not None:
            queries = queries[: cfg.reading.max_questions]
        done: set[tuple[str, str]] = set()
        attempt = 0
        prev = current_answers(ctx)
        if prev.num_rows:
            for m, q, e in zip(prev["method"].to_pylist(), prev["query_id"].to_pylist(), prev["error"].to_pylist()):
                if not is_failed_answer(e):
                    done.add((m, q))
            attempt = 1 + max((attempt_of(p) for p in parts_with_prefix(ctx.results, "answers", self.prefix(ctx))),
                              default=-1)
        units = []
        for method in cfg.reading.methods:
            todo = [q for q in queries if (method, q) not in done]
            for i, batch in enumerate(chunk(todo, cfg.llm.batch_size)):
                units.append({"part": f"{self.prefix(ctx)}{method}-a{attempt:04d}-{i:05d}", "size": len(batch), "method": method,
                              "queries": batch})
        return units

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        from memgas.pipeline.justmem.read import card_reading_payloads
        from memgas.pipeline.methods import reads_cards
        from memgas.pipeline.read import reading_payloads

        method, queries = unit["method"], unit["queries"]
        prefix = prefix_of(ctx, "rank")
        which = (pc.field("method") == method) & pc.field("query_id").isin(queries)
        rankings = ctx.results.read("rankings", parts=parts_with_prefix(ctx.results, "rankings", prefix),
                                    filter=which & (pc.field("rank") <= ctx.cfg.reading.top_k))
        if reads_cards(method):
            picks = ctx.results.read("card_picks", parts=parts_with_prefix(ctx.results, "card_picks", prefix),
                                     filter=which)
            try:
                payload = card_reading_payloads(ctx.bank, rankings, picks, queries, method=method,
                                                planner=plan_key(ctx))
            except KeyError as e:
                raise BankError(f"read: {e.args[0]}: run `memgas index` with this config") from None
            return {"method": method, "cards": True, "queries": payload}
        payload = reading_payloads(ctx.bank, rankings, queries, generation_key=generation_key(ctx))
        return {"method": method, "cards": False, "queries": payload}

    @staticmethod
    def run(model: Any, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.config import ReadingConfig
        from memgas.pipeline.justmem.read import read_and_answer_cards
        from memgas.pipeline.read import read_and_answer

        reading = ReadingConfig(**params["reading"])
        if payload["cards"]:
            table = read_and_answer_cards(payload["queries"], model, reading, params["replay_tokens"],
                                          payload["method"], temperature=params["temperature"], seed=params["seed"])
        else:
            table = read_and_answer(payload["queries"], model, reading, method=payload["method"],
                                    temperature=params["temperature"], seed=params["seed"])
        return {"answers": table}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.pipeline.read import is_failed_answer

        drop_other_parts(ctx.results, "answers", self.prefix(ctx))
        ans = current_answers(ctx)
        errors = ans["error"].to_pylist()
        failed = sum(is_failed_answer(e) for e in errors)
        return {"answers": ans.num_rows, "failed": failed,
                "prompt_tokens": int(pc.sum(ans["prompt_tokens"]).as_py() or 0),
                "completion_tokens": int(pc.sum(ans["completion_tokens"]).as_py() or 0),
                "notes": sum(e is not None for e in errors) - failed}

    def complete(self, ctx: StageContext) -> bool:
        return not ctx.stats.get(self.name, {}).get("failed")

    def latency_label(self, cfg: MemgasConfig) -> str | None:
        return f"reading (filter+answer, {cfg.llm.batch_size} query/batch)"


def current_answers(ctx: StageContext) -> pa.Table:
    """The answers of the read stage's current fingerprint (empty table when none)."""
    from memgas.pipeline.schema import ANSWERS

    parts = parts_with_prefix(ctx.results, "answers", prefix_of(ctx, "read"))
    return ctx.results.read("answers", parts=parts) if parts else ANSWERS.empty_table()
