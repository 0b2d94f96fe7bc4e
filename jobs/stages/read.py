"""The read stage: answers from the top-ranked sessions of the MemGAS methods (the JustMem methods are the
card reader's, :class:`memgas.jobs.stages.justmem.CardReadStage`, which shares this code)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs import keys, tables
from memgas.jobs.stage import Active, Stage, StageContext
from memgas.jobs.stages.rank import family_methods
from memgas.jobs.units import attempt_of, chunk

#: settings of both readers (``reading.methods`` enters a reader's key as its own methods only)
READ_FIELDS = ("reading.enabled", "reading.methods", "reading.top_k", "reading.filter", "reading.max_questions",
               "reading.context_tokens", "reading.max_new_tokens")

ANSWERS = tables.Table("answers", "fingerprint", "results", retried=True)


class ReadStage(Stage):
    """Filter the top-K retrieved sessions, then answer (one LLM actor, batched across queries).

    Answers that failed in the LLM backend (after the client's own retries) are kept out of the QA metrics,
    counted, and re-planned on the next run; the stage is complete only when none is left.
    """

    name = "read"
    reads = ("queries", "sessions", "texts", "rankings", "generations")
    writes = (ANSWERS,)
    fields = (*READ_FIELDS, *keys.LLM_OUTPUT_FIELDS)
    where = "actor"
    model = "llm"
    #: the retrieval methods this reader answers for (:func:`memgas.pipeline.methods.get_method` family)
    family = "memgas"
    #: the table of their rankings
    ranked_in = "rankings"

    def active(self, ctx: StageContext) -> Active | None:
        from memgas.pipeline.prompts import READING_PROMPT_DIGEST

        cfg = ctx.cfg
        methods = family_methods(cfg.reading.methods, self.family)
        if not cfg.reading.enabled or not methods:
            return None
        return Active(fields=tuple(f for f in self.fields if f not in ("reading.methods", "justmem.replay_tokens")),
                      resolved={**keys.llm_resolved(ctx, READING_PROMPT_DIGEST), "methods": methods},
                      params={"reading": cfg.reading.model_dump(), "temperature": cfg.llm.temperature, "seed": cfg.seed,
                              "replay_tokens": cfg.justmem.replay_tokens, "methods": methods},
                      model={"llm": cfg.llm.model_dump(), "llm_runtime": ctx.resolved.get("llm"), "seed": cfg.seed})

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        from memgas.pipeline.read import is_failed_answer

        cfg = ctx.cfg
        queries = ctx.bank.read("queries", ["query_id"])["query_id"].to_pylist()
        if cfg.reading.max_questions is not None:
            queries = queries[: cfg.reading.max_questions]
        done: set[tuple[str, str]] = set()
        attempt = 0
        own = self.writes[0].name
        prev = current_answers(ctx, (own,))
        if prev.num_rows:
            for m, q, e in zip(prev["method"].to_pylist(), prev["query_id"].to_pylist(), prev["error"].to_pylist()):
                if not is_failed_answer(e):
                    done.add((m, q))
            attempt = 1 + max((attempt_of(p) for p in tables.current_parts(ctx, own)), default=-1)
        units = []
        for method in family_methods(cfg.reading.methods, self.family):
            todo = [q for q in queries if (method, q) not in done]
            for batch in chunk(todo, cfg.llm.batch_size):
                units.append({"tag": f"{method}-a{attempt:04d}", "size": len(batch), "method": method,
                              "queries": batch})
        return units

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        from memgas.pipeline.read import reading_payloads

        method, queries = unit["method"], unit["queries"]
        rankings = self._rankings(ctx, method, queries)
        payload = reading_payloads(ctx.bank, rankings, queries, generation_key=keys.generation_key(ctx))
        return {"method": method, "cards": False, "queries": payload}

    def _rankings(self, ctx: StageContext, method: str, queries: list[str]) -> pa.Table:
        which = (pc.field("method") == method) & pc.field("query_id").isin(queries)
        return tables.read_current(ctx, self.ranked_in, filter=which & (pc.field("rank") <= ctx.cfg.reading.top_k))

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

        ans = current_answers(ctx, (self.writes[0].name,))
        errors = ans["error"].to_pylist()
        failed = sum(is_failed_answer(e) for e in errors)
        return {"answers": ans.num_rows, "failed": failed,
                "prompt_tokens": int(pc.sum(ans["prompt_tokens"]).as_py() or 0),
                "completion_tokens": int(pc.sum(ans["completion_tokens"]).as_py() or 0),
                "notes": sum(e is not None for e in errors) - failed, "unfinished": failed}


#: the tables of answers, MemGAS's and JustMem's
ANSWER_TABLES = ("answers", "card_answers")


def current_answers(ctx: StageContext, names: tuple[str, ...] = ANSWER_TABLES) -> pa.Table:
    """The current answers of the readers of ``names`` (empty table when none)."""
    from memgas.pipeline.schema import ANSWERS as SCHEMA

    if ctx.results is None:
        return SCHEMA.empty_table()
    parts = [p for n in names for p in tables.current_parts(ctx, n)]
    return ctx.results.read("answers", parts=sorted(parts)) if parts else SCHEMA.empty_table()
