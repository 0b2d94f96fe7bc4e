"""The read stage: answers from the top-ranked sessions of the MemGAS methods, and what the readers share
(the JustMem methods are the card reader's, :class:`memgas.jobs.stages.justmem.CardReadStage`, memgas-cards is
:class:`memgas.jobs.stages.card_graph_read.CardGraphReadStage`; both call these functions)."""

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


def reader_active(ctx: StageContext, stage: Stage, family: str) -> Active | None:
    """A reader's activity: None unless reading is on and ``family`` has a method to read; its key holds its
    own methods (``reading.methods`` of another family changes nothing here)."""
    from memgas.pipeline.prompts import READING_PROMPT_DIGEST

    cfg = ctx.cfg
    methods = family_methods(cfg.reading.methods, family)
    if not cfg.reading.enabled or not methods:
        return None
    return Active(fields=tuple(f for f in stage.fields if f not in ("reading.methods", "justmem.replay_tokens")),
                  resolved={**keys.llm_resolved(ctx, READING_PROMPT_DIGEST), "methods": methods},
                  params={"reading": cfg.reading.model_dump(), "temperature": cfg.llm.temperature, "seed": cfg.seed,
                          "methods": methods},
                  model={"llm": cfg.llm.model_dump(), "llm_runtime": ctx.resolved.get("llm"), "seed": cfg.seed})


def read_units(ctx: StageContext, stage: Stage, family: str) -> list[dict[str, Any]]:
    """Per method of ``family``, batches (``llm.batch_size``) of the questions not yet answered without a
    failure; a re-plan after failures is the next attempt (its parts tagged ``a0001``, ...)."""
    from memgas.pipeline.read import is_failed_answer

    cfg = ctx.cfg
    queries = ctx.bank.read("queries", ["query_id"])["query_id"].to_pylist()
    if cfg.reading.max_questions is not None:
        queries = queries[: cfg.reading.max_questions]
    done: set[tuple[str, str]] = set()
    attempt = 0
    own = stage.writes[0].name
    prev = current_answers(ctx, (own,))
    if prev.num_rows:
        for m, q, e in zip(prev["method"].to_pylist(), prev["query_id"].to_pylist(), prev["error"].to_pylist()):
            if not is_failed_answer(e):
                done.add((m, q))
        attempt = 1 + max((attempt_of(p) for p in tables.current_parts(ctx, own)), default=-1)
    units = []
    for method in family_methods(cfg.reading.methods, family):
        todo = [q for q in queries if (method, q) not in done]
        for batch in chunk(todo, cfg.llm.batch_size):
            units.append({"tag": f"{method}-a{attempt:04d}", "size": len(batch), "method": method, "queries": batch})
    return units


def top_rankings(ctx: StageContext, stage: Stage, family: str, method: str, queries: list[str]) -> pa.Table:
    """The top ``reading.top_k`` sessions of ``method`` for ``queries``, from the table that holds the
    rankings of ``family`` before ``stage`` (:func:`memgas.jobs.tables.ranking`: the ranker's, or a
    re-ranker's after it)."""
    which = (pc.field("method") == method) & pc.field("query_id").isin(queries)
    name = tables.resolve(ctx, tables.ranking(family), stage)
    if name is None:
        raise KeyError(f"no step before {stage.name!r} ranks the {family!r} methods")
    return tables.read_current(ctx, name, filter=which & (pc.field("rank") <= ctx.cfg.reading.top_k))


def session_inputs(ctx: StageContext, stage: Stage, family: str, unit: dict[str, Any]) -> dict[str, Any]:
    """A unit's reading payloads from its questions' top-ranked sessions."""
    from memgas.pipeline.read import reading_payloads

    method, queries = unit["method"], unit["queries"]
    rankings = top_rankings(ctx, stage, family, method, queries)
    payload = reading_payloads(ctx.bank, rankings, queries, generation_key=keys.generation_key(ctx))
    return {"method": method, "cards": False, "queries": payload}


def answer_sessions(model: Any, payload: dict[str, Any], params: dict[str, Any]) -> pa.Table:
    """Filter the payload's sessions, then answer (in the worker)."""
    from memgas.pipeline.config import ReadingConfig
    from memgas.pipeline.read import read_and_answer

    return read_and_answer(payload["queries"], model, ReadingConfig(**params["reading"]), method=payload["method"],
                           temperature=params["temperature"], seed=params["seed"])


def reader_finish(ctx: StageContext, stage: Stage) -> dict[str, Any]:
    """A reader's stats: its answers, failures (left for the next run: ``unfinished``), notes and tokens."""
    from memgas.pipeline.read import is_failed_answer

    ans = current_answers(ctx, (stage.writes[0].name,))
    errors = ans["error"].to_pylist()
    failed = sum(is_failed_answer(e) for e in errors)
    return {"answers": ans.num_rows, "failed": failed,
            "prompt_tokens": int(pc.sum(ans["prompt_tokens"]).as_py() or 0),
            "completion_tokens": int(pc.sum(ans["completion_tokens"]).as_py() or 0),
            "notes": sum(e is not None for e in errors) - failed, "unfinished": failed}


class ReadStage(Stage):
    """Filter the top-K retrieved sessions, then answer (one LLM actor, batched across queries).

    Answers that failed in the LLM backend (after the client's own retries) are kept out of the QA metrics,
    counted, and re-planned on the next run; the stage is complete only when none is left.
    """

    name = "read"
    reads = ("queries", "sessions", "texts", tables.ranking("memgas"), "generations")
    writes = (ANSWERS,)
    fields = (*READ_FIELDS, *keys.LLM_OUTPUT_FIELDS)
    where = "actor"
    model = "llm"

    def active(self, ctx: StageContext) -> Active | None:
        return reader_active(ctx, self, "memgas")

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        return read_units(ctx, self, "memgas")

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        return session_inputs(ctx, self, "memgas", unit)

    @staticmethod
    def run(model: Any, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        return {"answers": answer_sessions(model, payload, params)}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        return reader_finish(ctx, self)


#: the tables of answers: MemGAS's, JustMem's and memgas-cards'
ANSWER_TABLES = ("answers", "card_answers", "card_graph_answers")


def current_answers(ctx: StageContext, names: tuple[str, ...] = ANSWER_TABLES) -> pa.Table:
    """The current answers of the readers of ``names`` that the running step reads under this config (a step
    leaves memgas-cards' answers out of its reads while that reader is disabled: its fingerprint stays what it
    was without it) (empty table when none)."""
    from memgas.pipeline.schema import ANSWERS as SCHEMA

    if ctx.results is None:
        return SCHEMA.empty_table()
    parts = [p for n in names if tables.may_read(ctx, n) for p in tables.current_parts(ctx, n)]
    return ctx.results.read("answers", parts=sorted(parts)) if parts else SCHEMA.empty_table()
