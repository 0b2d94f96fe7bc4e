"""The cards stage: JustMem memory cards per unique session."""

from __future__ import annotations

import logging
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs import keys, tables
from memgas.jobs.models import JustMemModel
from memgas.jobs.stage import Active, Stage, StageContext
from memgas.jobs.stages.justmem import current_cards, justmem_enabled, justmem_model, session_cards
from memgas.jobs.units import even_chunks
from memgas.pipeline.errors import LLMCallsFailed
from memgas.pipeline.justmem.llm_estimate import llm_extractor_estimate

log = logging.getLogger(__name__)


def _this_config(ctx: StageContext) -> pa.Table:
    """This config's cards of the bank's sessions (other configs' rows in the shared table must not change
    what downstream sees)."""
    return session_cards(ctx).sort_by([("card_id", "ascending")])


CARDS = tables.Table("cards", "content", rows=_this_config)


class CardsStage(Stage):
    """JustMem memory cards per unique session (``extract_cards``; LLM-free by default).

    Content-addressed like generate: rows are keyed by (session hash, ``extractor`` = extractor key @ its
    key), shared by every history, config and dataset of the bank; a unit holds only sessions still without
    cards. The card texts stay in ``cards.text`` (not copied into ``texts``): the JustMem encoder reads them
    from there, as it reads questions from ``queries``.
    """

    name = "cards"
    version = keys.PRODUCER_VERSIONS["cards"]
    reads = ("sessions", "turns")
    writes = (CARDS,)
    fields = keys.EXTRACTOR_FIELDS
    where = "actor"
    model = "justmem"

    def active(self, ctx: StageContext) -> Active | None:
        from memgas.pipeline.methods import uses_card_graph

        # JustMem's methods read the cards, and so does memgas-cards (jobs/stages/card_graph.py)
        if not (justmem_enabled(ctx.cfg) or uses_card_graph(ctx.cfg.retrieval.methods)):
            return None
        fields, resolved = keys.extractor_identity(ctx)
        cfg = ctx.cfg
        return Active(fields=fields, resolved=resolved,
                      params={"key": keys.cards_key(ctx), "temperature": cfg.llm.temperature, "seed": cfg.seed},
                      model=justmem_model(ctx, keys.extractor_uses_llm(cfg)))

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        bank = ctx.bank
        sessions = sorted(set(bank.read("sessions", ["text_hash"])["text_hash"].to_pylist()))
        have: set[str] = set()
        if bank.exists("cards"):
            have = set(bank.read("cards", ["session_hash"], filter=pc.field("extractor") == keys.cards_key(ctx))
                       ["session_hash"].to_pylist())
        missing = [h for h in sessions if h not in have]
        says = llm_extractor_estimate(ctx.cfg, (ctx.resolved.get("llm") or {}).get("device"), len(missing))
        if says:
            log.warning("%s", says)
        kind = (bank.manifest.get("datasets") or [{}])[-1].get("format")
        return [{"size": len(b), "kind": kind, "sessions": b} for b in even_chunks(missing, ctx.cfg.ray.generate_unit)]

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        from memgas.pipeline.justmem.extract import turns_by_session

        turns = turns_by_session(ctx.bank.read("turns", ["session_hash", "turn_index", "role", "content"],
                                               filter=pc.field("session_hash").isin(unit["sessions"])))
        return {"kind": unit["kind"],
                "sessions": [[h, [[t.turn_index, t.role, t.content] for t in turns.get(h, [])]]
                             for h in unit["sessions"]]}

    @staticmethod
    def run(model: JustMemModel, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.justmem.extract import Turn, extract_cards

        sessions = [(h, [Turn(int(i), r, c) for i, r, c in turns], payload["kind"]) for h, turns in payload["sessions"]]
        return {"cards": extract_cards(sessions, model.cfg, key=params["key"], llm=model.llm,
                                       temperature=params["temperature"], seed=params["seed"])}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.pipeline.justmem.extract import dropped_cards

        failed = _failed_sessions(ctx)
        # the card stages after this one would rank and read without these sessions: stop; the next run retries
        stop = LLMCallsFailed(f"cards: {failed} sessions failed in the LLM backend (no cards stored for them); "
                              "check llm.backend/llm.base_url and re-run (finished sessions are kept)")
        mine = current_cards(ctx) if ctx.bank.exists("cards") else None
        if mine is None:
            return {"rows": 0, "sessions": 0, "llm_failures": failed, "unfinished": failed, "stop": stop}
        return {"rows": mine.num_rows, "sessions": len(set(mine["session_hash"].to_pylist())),
                "prompt_tokens": int(pc.sum(mine["prompt_tokens"]).as_py() or 0),
                "completion_tokens": int(pc.sum(mine["completion_tokens"]).as_py() or 0),
                "fallbacks": len(set(mine.filter(pc.is_valid(mine["fallback"]))["session_hash"].to_pylist())),
                # the LLM's cards that failed a check (ungrounded, repeated, cut off) in replies kept otherwise
                "dropped_cards": dropped_cards(mine),
                "llm_failures": failed, "unfinished": failed, "stop": stop}


def _failed_sessions(ctx: StageContext) -> int:
    """Sessions with text but no cards under this config's key: their LLM call failed in the backend (a session
    with text always gets at least one card otherwise, its LLM-free fallback if need be)."""
    bank = ctx.bank
    sessions = set(bank.read("sessions", ["text_hash"])["text_hash"].to_pylist())
    if bank.exists("cards"):
        sessions -= set(bank.read("cards", ["session_hash"], filter=pc.field("extractor") == keys.cards_key(ctx))
                        ["session_hash"].to_pylist())
    if not sessions:
        return 0
    turns = bank.read("turns", ["session_hash", "content"], filter=pc.field("session_hash").isin(sorted(sessions)))
    return len({h for h, c in zip(turns["session_hash"].to_pylist(), turns["content"].to_pylist()) if c.strip()})
