"""The cards stage: JustMem memory cards per unique session."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs.stage import StageContext, table_digest
from memgas.jobs.stages.fields import LLM_OUTPUT_FIELDS, present_fields
from memgas.jobs.stages.justmem import JustMemActorStage
from memgas.jobs.stages.keys import cards_key
from memgas.jobs.stages.models import JustMemModel
from memgas.jobs.stages.units import even_chunks
from memgas.pipeline.config import MemgasConfig


class CardsStage(JustMemActorStage):
    """JustMem memory cards per unique session (``extract_cards``; LLM-free by default).

    Content-addressed like generate: rows are keyed by (session hash, ``extractor`` = extractor key @ this
    stage's cache key), shared by every history, config and dataset of the bank; a unit holds only sessions
    still without cards. The card texts stay in ``cards.text`` (not copied into ``texts``): the encode stage
    reads them from there, as it reads questions from ``queries``, so no second stage writes (and compacts)
    the shared ``texts`` table under the generate stage's marker.
    """

    name = "cards"
    upstream = ("ingest",)
    config_fields = ("justmem.extractor", "justmem.extract_max_tokens", "justmem.extract_max_input_tokens",
                     *LLM_OUTPUT_FIELDS)
    check_table = "cards"
    outputs = ("cards",)

    def uses_llm(self, cfg: MemgasConfig) -> bool:
        return cfg.justmem.extractor == "llm"

    def active_fields(self, cfg: MemgasConfig) -> tuple[str, ...]:
        own = ["justmem.extractor"]
        if self.uses_llm(cfg):
            own += ["justmem.extract_max_tokens", "justmem.extract_max_input_tokens", *LLM_OUTPUT_FIELDS]
        return present_fields(cfg, tuple(own))

    def resolved_inputs(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.pipeline.justmem.extract import LLM_FREE_EXTRACTOR
        from memgas.pipeline.prompts import JUSTMEM_EXTRACT_PROMPT_DIGEST

        if not self.uses_llm(ctx.cfg):
            return {"llm_free": LLM_FREE_EXTRACTOR}
        return self._llm_resolved(ctx, JUSTMEM_EXTRACT_PROMPT_DIGEST)

    def key(self, ctx: StageContext) -> str:
        """The ``extractor`` column of this config's rows: the readable extractor key @ the cache key."""
        return cards_key(ctx)

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        bank = ctx.bank
        sessions = sorted(set(bank.read("sessions", ["text_hash"])["text_hash"].to_pylist()))
        have: set[str] = set()
        if bank.exists("cards"):
            have = set(bank.read("cards", ["session_hash"], filter=pc.field("extractor") == self.key(ctx))
                       ["session_hash"].to_pylist())
        missing = [h for h in sessions if h not in have]
        kind = (bank.manifest.get("datasets") or [{}])[-1].get("format")
        fp = ctx.fingerprints[self.name]
        return [{"part": f"cards-{fp}-{i:05d}", "size": len(b), "kind": kind, "sessions": b}
                for i, b in enumerate(even_chunks(missing, ctx.cfg.ray.generate_unit))]

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

    def mine(self, ctx: StageContext) -> pa.Table:
        """This config's rows of ``cards`` (the table is shared by every config)."""
        return ctx.bank.read("cards", filter=pc.field("extractor") == self.key(ctx))

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.jobs.plan import compact

        if ctx.bank.exists("cards"):
            compact(ctx.bank, "cards")
        mine = self.mine(ctx) if ctx.bank.exists("cards") else None
        if mine is None:
            return {"rows": 0, "sessions": 0}
        return {"rows": mine.num_rows, "sessions": len(set(mine["session_hash"].to_pylist())),
                "prompt_tokens": int(pc.sum(mine["prompt_tokens"]).as_py() or 0),
                "completion_tokens": int(pc.sum(mine["completion_tokens"]).as_py() or 0),
                "fallbacks": int(pc.sum(pc.is_valid(mine["fallback"])).as_py() or 0)}

    def output_digest(self, ctx: StageContext, parts: dict[str, str]) -> str:
        """This config's rows (other configs' rows in the shared table must not change what downstream sees)."""
        return table_digest(self.mine(ctx).sort_by([("card_id", "ascending")]))
