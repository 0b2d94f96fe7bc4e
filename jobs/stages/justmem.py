"""The JustMem branch beyond its cards and plans: encoding the cards and rewrites, ranking the cards, reading
them; and what its stages share (whether they run, their actor, this config's cards and plans).

The branch reads only ingest's tables and its own, so a change of a MemGAS setting re-runs none of it, and
a change of a ``justmem.*`` setting re-runs no MemGAS stage. Texts are shared by content: the JustMem
encoder writes the same ``embeddings`` rows as MemGAS's (one encoder key), so a question both branches need
is encoded once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs import keys, tables
from memgas.jobs.history_index import READ_BATCH_ROWS
from memgas.jobs.stage import Active, Stage, StageContext
from memgas.jobs.stages.read import (
    READ_FIELDS,
    answer_sessions,
    read_units,
    reader_active,
    reader_finish,
    session_inputs,
    top_rankings,
)
from memgas.jobs.stages.encode import (embed, needed_inputs, needed_stats, plan_needed, vector_rows, vector_rows_digest,
                                       vector_rows_summed)
from memgas.jobs.stages.rank import family_methods, query_vectors, ranking_rows
from memgas.jobs.stages.ranked import Kept, ranked_table, with_history
from memgas.jobs.stages.shards import kernel_active, owned
from memgas.kernels.backend import one_blas_thread
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.errors import BankError

#: JustMem retrieval settings the card ranker reads
JUSTMEM_RANK_FIELDS: tuple[str, ...] = ("justmem.candidates", "justmem.top_k", "justmem.rewrites", "justmem.reranker",
                                         "justmem.wide_candidates", "justmem.entity_weight", "justmem.time_weight",
                                         "justmem.prf_cards", "justmem.prf_terms", "justmem.prf_weight",
                                         "justmem.session_cap")


def justmem_enabled(cfg: MemgasConfig) -> bool:
    """The JustMem branch runs only when a JustMem method is selected (ranked, or read)."""
    from memgas.pipeline.methods import uses_justmem

    return uses_justmem(cfg.retrieval.methods) or (cfg.reading.enabled and uses_justmem(cfg.reading.methods))


def justmem_model(ctx: StageContext, use_llm: bool) -> dict[str, Any]:
    """What a cards or plan actor loads: the ``justmem`` section, and the LLM only where ``use_llm``."""
    cfg = ctx.cfg
    return {"justmem": cfg.justmem.model_dump(), "llm": cfg.llm.model_dump(), "seed": cfg.seed, "use_llm": use_llm,
            "llm_runtime": ctx.resolved.get("llm") if use_llm else None}


# -- this config's cards and plans --------------------------------------------------------------------------
def current_plans(ctx: StageContext, query_ids: list[str] | None = None) -> pa.Table:
    """The plans of the plan stage's current fingerprint (optionally of ``query_ids``)."""
    return tables.read_current(ctx, "plans", filter=None if query_ids is None else pc.field("query_id").isin(query_ids))


def current_cards(ctx: StageContext, session_hashes: list[str] | None = None) -> pa.Table:
    """This config's cards (optionally of ``session_hashes``)."""
    f = pc.field("extractor") == keys.cards_key(ctx)
    if session_hashes is not None:
        f = f & pc.field("session_hash").isin(session_hashes)
    return ctx.bank.read("cards", filter=f)


def bank_session_hashes(ctx: StageContext) -> list[str]:
    """The text hashes of the bank's sessions now (the content tables keep the rows of every dataset the
    bank held: an ingest with a smaller ``data.limit`` leaves the others' cards and generations there)."""
    return sorted(set(ctx.bank.read("sessions", ["text_hash"])["text_hash"].to_pylist()))


def session_cards(ctx: StageContext) -> pa.Table:
    """This config's cards of the bank's sessions now: what is encoded, ranked and counted (not every card the
    shared table holds; a bank re-ingested with a smaller ``data.limit`` encoded 57,765 cards for 2 questions)."""
    return current_cards(ctx, bank_session_hashes(ctx))


def justmem_texts(ctx: StageContext) -> dict[str, str]:
    """{text_hash: text} of this config's card texts of the bank's sessions and plan rewrites (encoded under
    the main key)."""
    from memgas.pipeline.hashing import text_hash

    cards = session_cards(ctx)
    out = dict(zip(cards["text_hash"].to_pylist(), cards["text"].to_pylist()))
    for rewrites in current_plans(ctx)["rewrites"].to_pylist():
        for r in rewrites or []:
            out[text_hash(r)] = r
    return out


# -- encoding the cards and rewrites ---------------------------------------------------------------------
def _card_vector_rows(ctx: StageContext) -> pa.Table:
    return vector_rows(ctx, CardEncodeStage.needed(ctx)[0])


#: the vectors of the cards, the plans' rewrites and the questions (rows of ``embeddings``)
CARD_VECTORS = tables.Table("card_vectors", "content", stored_in="embeddings", rows=_card_vector_rows,
                            digest=lambda ctx: vector_rows_digest(ctx, CardEncodeStage.needed(ctx)[0]),
                            summed=lambda ctx: vector_rows_summed(ctx, CardEncodeStage.needed(ctx)[0]))


class CardEncodeStage(Stage):
    """Embed every card text, plan rewrite and question under the main encoder key (what MemGAS's encoder
    embedded already is not embedded again: the rows are keyed by text and encoder)."""

    name = "card-encode"
    version = "1"
    reads = ("cards", "plans", "queries")
    writes = (CARD_VECTORS,)
    fields = keys.ENCODER_OUTPUT_FIELDS
    where = "actor"
    model = "encoder"

    def active(self, ctx: StageContext) -> Active | None:
        if not justmem_enabled(ctx.cfg):
            return None
        fields, resolved = keys.encoder_identity(ctx)
        return Active(fields=fields, resolved=resolved, model={"encoder": keys.encoder_config(ctx)})

    @staticmethod
    def needed(ctx: StageContext) -> tuple[dict[str, list[str]], dict[str, str]]:
        from memgas.pipeline.encode import query_hash

        texts = {query_hash(q): q for q in ctx.bank.read("queries", ["question"])["question"].to_pylist()}
        texts.update({h: t for h, t in justmem_texts(ctx).items() if h not in texts})
        return {keys.encoder_key(ctx): sorted(texts)}, texts

    plan, inputs, finish, run = plan_needed, needed_inputs, needed_stats, staticmethod(embed)


# -- ranking the cards ------------------------------------------------------------------------------------
def card_history_tables(ctx: StageContext, queries: pa.Table) -> dict[str, pa.Table]:
    """A history's questions, sessions, their cards and the questions' plans (the card and question vectors
    follow from those texts and the encoder's key)."""
    sessions = ctx.bank.read("sessions")
    return {"queries": queries, "sessions": sessions,
            "cards": with_history(session_cards(ctx), "session_hash", sessions, "text_hash"),
            "plans": with_history(current_plans(ctx), "query_id", queries, "query_id")}


#: JustMem's rankings (rows of ``rankings``) and each card reader's chosen cards, kept per history across
#: appends as MemGAS's are (:mod:`memgas.jobs.stages.ranked`), with what each part's histories were ranked from
KEPT = Kept("card_ranked_histories", card_history_tables)
CARD_RANKED = tables.Table("card_ranked_histories", "segmented", "results", stored_in="ranked_histories",
                           current=KEPT.current)
CARD_RANKINGS = tables.Table("card_rankings", "segmented", "results", stored_in="rankings", current=KEPT.current,
                             ranks="justmem")
CARD_PICKS = tables.Table("card_picks", "segmented", "results", current=KEPT.current)


def card_rank_inputs(ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
    """A unit's payload: per history with questions, its sessions, cards, plans and their vectors."""
    from memgas.pipeline.hashing import text_hash

    bank, ids, key = ctx.bank, unit["histories"], keys.encoder_key(ctx)
    queries = bank.read("queries", ["query_id", "history_id", "question", "question_date"],
                        filter=pc.field("history_id").isin(ids))
    if queries.num_rows == 0:
        return {"histories": []}
    qdf = queries.to_pandas()
    qv = query_vectors(bank, qdf["question"].tolist(), key)
    sess = bank.read("sessions", ["history_id", "session_id", "position", "text_hash", "date"],
                     filter=pc.field("history_id").isin(ids)).sort_by([("history_id", "ascending"),
                                                                       ("position", "ascending")])
    order: dict[str, list[tuple[str, str]]] = {}
    dates: dict[str, list[Any]] = {}
    for h, s, t, d in zip(*(sess[c].to_pylist() for c in ("history_id", "session_id", "text_hash", "date"))):
        order.setdefault(h, []).append((s, t))
        dates.setdefault(h, []).append(d)
    cards = current_cards(ctx, sorted({t for pairs in order.values() for _, t in pairs}))
    plans = {r["query_id"]: r for r in current_plans(ctx, qdf["query_id"].tolist()).to_pylist()}
    rewrites = sorted({r for p in plans.values() for r in (p["rewrites"] or [])})
    texts = sorted(set(cards["text"].to_pylist()) | set(rewrites))
    # a batch of embeddings at a time: the unit's card vectors out of the whole table (same rows)
    vecs = query_vectors(bank, texts, key, READ_BATCH_ROWS) if texts else np.zeros((0, 0), np.float32)
    vectors = {text_hash(t): vecs[i] for i, t in enumerate(texts)}
    out = []
    for h, g in qdf.groupby("history_id", sort=True):
        if h not in order:
            continue
        hashes = [t for _, t in order[h]]
        mine = cards.filter(pc.field("session_hash").isin(sorted(set(hashes))))
        qplans = [plans.get(q) for q in g["query_id"].tolist()]
        missing = [q for q, p in zip(g["query_id"].tolist(), qplans) if p is None]
        if missing:
            raise BankError(f"no JustMem plan for query {missing[0]!r}: run `memgas index` with this config")
        out.append({"history_id": h, "session_ids": [s for s, _ in order[h]], "query_ids": g["query_id"].tolist(),
                    "queries": qv[g.index.to_numpy()], "session_hashes": hashes, "cards": mine,
                    "card_vectors": {t: vectors[t] for t in mine["text_hash"].to_pylist()},
                    "questions": g["question"].tolist(), "plans": qplans, "session_dates": dates[h],
                    "question_dates": [None if d != d else d.to_pydatetime() for d in g["question_date"]],
                    "rewrite_vectors": [np.stack([vectors[text_hash(r)] for r in p["rewrites"]])
                                        if p["rewrites"] else None for p in qplans]})
    return {"histories": out}


class CardRankStage(Stage):
    """Per shard of histories: every query ranked by every JustMem method from the history's cards (session
    rankings from the card order keep its metrics comparable with MemGAS's), and the cards each card reader
    reads (``card_picks``). Only the histories whose questions, sessions, cards or plans changed since the
    run directory's last answer are ranked."""

    name = "card-rank"
    #: 2: parts per shard of changed histories, named by config (1: by fingerprint); 3: the plan's entities,
    #: time constraints (against the session and question dates) and operation shape retrieval, and Compose
    #: feeds back terms from its top cards
    version = "3"
    reads = ("queries", "sessions", "cards", "plans", "card_vectors")
    writes = (CARD_RANKED, CARD_RANKINGS, CARD_PICKS)
    where = "task"
    fields = ("retrieval.methods", "retrieval.store_top", "retrieval.device", *JUSTMEM_RANK_FIELDS)

    def active(self, ctx: StageContext) -> Active | None:
        methods = family_methods(ctx.cfg.retrieval.methods, "justmem")
        if not methods:
            return None
        active = kernel_active(ctx)
        active.fields = tuple(f for f in self.fields if f != "retrieval.methods")
        active.resolved["methods"] = methods
        active.params.update(retrieval={**ctx.cfg.retrieval.model_dump(), "methods": methods},
                             justmem=ctx.cfg.justmem.model_dump())
        return active

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        return KEPT.plan(self, ctx)

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        return KEPT.inputs(card_rank_inputs(ctx, unit), unit)

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        return KEPT.finish(self, ctx)

    @staticmethod
    def run(model: None, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.methods import get_method
        from memgas.pipeline.schema import CARD_PICKS as PICKS
        from memgas.pipeline.schema import RANKINGS

        r = params["retrieval"]
        cols: dict[str, list] = {"method": [], "query_id": [], "rank": [], "session_id": [], "score": []}
        picks: dict[str, list] = {"method": [], "query_id": [], "rank": [], "card_id": [], "profile": []}
        for h in payload["histories"]:
            with one_blas_thread():
                card_ids, selections = CardRankStage.rank_cards(h, r["methods"], params["justmem"])
            ranking_rows(cols, h["session_ids"], h["query_ids"],
                         {m: (sel.order, sel.scores) for m, sel in selections.items()}, r["store_top"])
            for method, sel in selections.items():
                if not get_method(method).reads_cards:
                    continue
                for qi, qid in enumerate(h["query_ids"]):
                    ids = [card_ids[c] for c in sel.cards[qi]]
                    picks["method"] += [method] * len(ids)
                    picks["query_id"] += [qid] * len(ids)
                    picks["rank"] += list(range(1, len(ids) + 1))
                    picks["card_id"] += ids
                    picks["profile"] += [sel.profiles[qi]] * len(ids)
        return {"card_picks": pa.table(picks, schema=PICKS), "rankings": pa.table(cols, schema=RANKINGS),
                "ranked_histories": ranked_table(payload)}

    @staticmethod
    def rank_cards(h: dict[str, Any], methods: list[str], justmem: dict[str, Any]) -> tuple[list[str], dict]:
        """(the history's card ids in HistoryCards order, {method: CardSelection})."""
        from memgas.pipeline.config import JustMemConfig
        from memgas.pipeline.justmem.plan import Plan
        from memgas.pipeline.justmem.retrieve import HistoryCards, rank_cards

        hc = HistoryCards.from_table(h["session_hashes"], h["cards"], h["card_vectors"], h["session_dates"])
        plans = [Plan(list(p["entities"] or []), list(p["time_constraints"] or []), p["operation"], bool(p["d"]),
                      bool(p["f"]), list(p["rewrites"] or [])) for p in h["plans"]]
        cfg = JustMemConfig(**justmem)
        queries = owned(h["queries"], np.float32)
        return hc.card_ids, {m: rank_cards(hc, h["questions"], queries, m, cfg, plans=plans,
                                           rewrite_vecs=h["rewrite_vectors"], question_dates=h["question_dates"])
                             for m in methods}


# -- reading the cards -----------------------------------------------------------------------------------
CARD_ANSWERS = tables.Table("card_answers", "fingerprint", "results", stored_in="answers", retried=True)


class CardReadStage(Stage):
    """The JustMem methods' answers: the card readers (``methods.reads_cards``) from the card ranker's
    ``card_picks`` (:mod:`memgas.pipeline.justmem.read`: cards with their dates, the planner's operation,
    Replay's source turns within ``justmem.replay_tokens``); the others from their top-K sessions."""

    name = "card-read"
    reads = ("queries", "sessions", "texts", tables.ranking("justmem"), "card_picks", "cards", "plans", "turns",
             "generations")
    writes = (CARD_ANSWERS,)
    fields = (*READ_FIELDS, *keys.LLM_OUTPUT_FIELDS, "justmem.replay_tokens")
    where = "actor"
    model = "llm"

    def active(self, ctx: StageContext) -> Active | None:
        from memgas.pipeline.methods import reads_cards
        from memgas.pipeline.prompts import JUSTMEM_READ_PROMPT_DIGEST

        active = reader_active(ctx, self, "justmem")
        if active is None:
            return None
        active.params["replay_tokens"] = ctx.cfg.justmem.replay_tokens
        methods = active.resolved["methods"]
        if any(reads_cards(m) for m in methods):
            # justmem.replay_tokens shapes only the card readers' prompt; they name the planner's operation
            active.fields = (*active.fields, "justmem.replay_tokens")
            active.resolved.update(justmem_prompts=JUSTMEM_READ_PROMPT_DIGEST, planner=keys.plan_key(ctx))
        if all(reads_cards(m) for m in methods):  # summaries and keywords: only a session reader's prompt
            active.reads = tuple(t for t in self.reads if t != "generations")
        return active

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        return read_units(ctx, self, "justmem")

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        from memgas.pipeline.justmem.read import card_reading_payloads
        from memgas.pipeline.methods import reads_cards

        method, queries = unit["method"], unit["queries"]
        if not reads_cards(method):
            return session_inputs(ctx, self, "justmem", unit)
        rankings = top_rankings(ctx, self, "justmem", method, queries)
        picks = tables.read_current(ctx, "card_picks",
                                    filter=(pc.field("method") == method) & pc.field("query_id").isin(queries))
        try:
            payload = card_reading_payloads(ctx.bank, rankings, picks, queries, method=method,
                                            planner=keys.plan_key(ctx))
        except KeyError as e:
            raise BankError(f"read: {e.args[0]}: run `memgas index` with this config") from None
        return {"method": method, "cards": True, "queries": payload}

    @staticmethod
    def run(model: Any, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.config import ReadingConfig
        from memgas.pipeline.justmem.read import read_and_answer_cards

        if not payload["cards"]:  # a JustMem method that reads its top-K sessions, as MemGAS's reader
            return {"answers": answer_sessions(model, payload, params)}
        return {"answers": read_and_answer_cards(payload["queries"], model, ReadingConfig(**params["reading"]),
                                                 params["replay_tokens"], payload["method"],
                                                 temperature=params["temperature"], seed=params["seed"])}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        return reader_finish(ctx, self)
