"""card-graph-read: memgas-cards' answers. The answer model gets, per question, the method's top
``reading.top_k`` sessions as MemGAS's reader gives them (date, text; summaries and keywords for the filter step)
and, in each session's block under its date and before its text (so a session cut to fit keeps them), the
cards that ranked it (card-graph-rank's ``card_graph_picks``),
within MemGAS's reading budget: ``reading.top_k``, ``reading.context_tokens`` (and ``llm.context_tokens``),
``reading.max_new_tokens`` and ``reading.filter`` (with the filter step's own output budget); the lowest-ranked
sessions are dropped first, cards with their session (:func:`memgas.pipeline.read.build_context`)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs import keys, tables
from memgas.jobs.stage import Active, Stage, StageContext
from memgas.jobs.stages.card_graph import FAMILY
from memgas.jobs.stages.read import READ_FIELDS, answer_sessions, read_units, reader_active, reader_finish, top_rankings
from memgas.pipeline.errors import BankError

CARD_GRAPH_ANSWERS = tables.Table("card_graph_answers", "fingerprint", "results", stored_in="answers", retried=True)


def card_graph_read_enabled(cfg: Any) -> bool:
    """Whether memgas-cards is read (its reader runs; the judge and the report read its answers)."""
    from memgas.pipeline.methods import uses_card_graph

    return cfg.reading.enabled and uses_card_graph(cfg.reading.methods)


def card_graph_inputs(ctx: StageContext, stage: Any, method: str, queries: list[str], *,
                      generation_key: tuple[str, str] | None) -> list[dict[str, Any]]:
    """The reading payloads of ``queries`` under ``method``: its top sessions with the cards that ranked them
    (:func:`memgas.pipeline.card_graph_read.card_graph_reading_payloads`), as ``stage`` reads them."""
    from memgas.pipeline.card_graph_read import card_graph_reading_payloads

    rankings = top_rankings(ctx, stage, FAMILY, method, queries)
    picks = tables.read_current(ctx, "card_graph_picks", filter=(pc.field("method") == method)
                                & pc.field("query_id").isin(queries) & (pc.field("rank") <= ctx.cfg.reading.top_k))
    try:
        return card_graph_reading_payloads(ctx.bank, rankings, picks, queries, generation_key=generation_key)
    except KeyError as e:
        raise BankError(f"{stage.name}: {e.args[0]}: run `memgas index` with this config") from None


class CardGraphReadStage(Stage):
    """memgas-cards' answers (module docstring): MemGAS's filter and answer prompts, batched on one LLM actor;
    failed answers are counted, kept out of the QA metrics and re-planned on the next run, as the other
    readers'."""

    name = "card-graph-read"
    reads = ("queries", "sessions", "texts", tables.ranking(FAMILY), "card_graph_picks", "cards", "generations")
    writes = (CARD_GRAPH_ANSWERS,)
    fields = (*READ_FIELDS, *keys.LLM_OUTPUT_FIELDS)
    where = "actor"
    model = "llm"

    def active(self, ctx: StageContext) -> Active | None:
        from memgas.pipeline.prompts import CARD_GRAPH_READ_PROMPT_DIGEST

        active = reader_active(ctx, self, FAMILY)
        if active is not None:
            active.resolved["cards_prompt"] = CARD_GRAPH_READ_PROMPT_DIGEST
        return active

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        return read_units(ctx, self, FAMILY)

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        method = unit["method"]
        payload = card_graph_inputs(ctx, self, method, unit["queries"], generation_key=keys.generation_key(ctx))
        return {"method": method, "queries": payload}

    @staticmethod
    def run(model: Any, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        return {"answers": answer_sessions(model, payload, params)}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        return reader_finish(ctx, self)
