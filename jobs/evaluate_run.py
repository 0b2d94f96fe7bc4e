"""Evaluation of a run: retrieval metrics per method (session and turn level), QA metrics, LLM judge.

Joins the run's ``rankings``/``answers`` (results bank) with the bank's ``queries`` and hands records to
:mod:`memgas.pipeline.evaluate`. Returns the ``retrieval``/``qa`` sections of metrics.json; the run's
accounting beside them (LLM tokens per method, the planner's profiles, the encoded texts) is here too.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from memgas.jobs import tables
from memgas.jobs.keys import generation_key
from memgas.jobs.stage import StageContext
from memgas.jobs.stages.justmem import bank_session_hashes, current_plans, justmem_enabled, session_cards
from memgas.jobs.stages.read import current_answers
from memgas.pipeline.bank import Bank
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.evaluate.qa import score_qa
from memgas.pipeline.evaluate.retrieval import aggregate_retrieval, score_retrieval
from memgas.pipeline.models.synthetic import SYNTHETIC_NOTE, is_synthetic

log = logging.getLogger(__name__)


def _clean(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return None
    if hasattr(v, "item"):
        return _clean(v.item())
    return v


def _agg_to_dict(agg: pd.DataFrame) -> dict[str, Any]:
    """aggregate_* output (index overall + types) -> {"overall": {...}, "by_type": {t: {...}}}."""
    rows = {str(idx): {k: _clean(v) for k, v in row.items()} for idx, row in agg.iterrows()}
    overall = rows.pop("overall", {})
    return {"overall": overall, "by_type": rows}


def evaluate_run(cfg: MemgasConfig, bank: Bank, results: Bank, *,
                 parts: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """The ``retrieval`` and ``qa`` sections of metrics.json.

    ``parts``: per results table, the parts of the current run's fingerprints (other parts are stale);
    None reads every part. Answers whose LLM call failed are not scored: they are counted in ``failed``.
    """
    from memgas.pipeline.read import is_failed_answer

    def read(name: str) -> pd.DataFrame | None:
        chosen = None if parts is None else parts.get(name, [])
        if chosen == [] or not results.exists(name):
            return None
        return results.read(name, parts=chosen).to_pandas()

    queries = bank.read("queries").to_pandas()
    rankings = read("rankings")
    if rankings is None:
        rankings = pd.DataFrame(columns=["method", "query_id", "rank", "session_id", "score"])
    out: dict[str, Any] = {"n_queries": int(len(queries)), "retrieval": {"session": {}, "turn": {}}, "qa": {}}
    if is_synthetic(cfg.encoder.model):  # vectors from hashes: the numbers below measure nothing
        out = {"synthetic_encoder": True, **out, "notes": {"synthetic_encoder": SYNTHETIC_NOTE}}
    qinfo = queries.set_index("query_id")
    for method in cfg.retrieval.methods:
        r = rankings[rankings["method"] == method].sort_values(["query_id", "rank"], kind="stable")
        ranked = {q: g["session_id"].tolist() for q, g in r.groupby("query_id", sort=False)}
        records = [
            {
                "query_id": q,
                "ranked_ids": ranked.get(q, []),
                "evidence_ids": list(row.evidence_session_ids) if row.evidence_session_ids is not None else [],
                "is_abstention": bool(row.is_abstention),
                "question_type": row.question_type,
            }
            for q, row in qinfo.iterrows()
        ]
        per_q, skipped = score_retrieval(records, cfg.evaluation.ks)
        agg = _agg_to_dict(aggregate_retrieval(per_q))
        out["retrieval"]["session"][method] = {**agg, "n_evaluated": int(len(per_q)), "skipped": skipped}
        turn = _turn_level(qinfo, ranked, bank, cfg)
        if turn is not None:
            out["retrieval"]["turn"][method] = turn
    log_skipped(out["retrieval"])
    if not out["retrieval"]["turn"]:
        out["retrieval"].pop("turn")
    else:
        out.setdefault("notes", {})["turn_level"] = TURN_NOTE

    answers = read("answers")
    judgments = read("judgments")
    if answers is not None:
        for method, g in answers.groupby("method", sort=True):
            failed = g["error"].map(is_failed_answer)
            scored = g[~failed]
            df = scored.merge(queries[["query_id", "question", "answer", "question_type", "is_abstention"]], on="query_id")
            df["hypothesis"] = df["hypothesis"].fillna("")
            entry: dict[str, Any] = {"n": int(len(df)), "failed": int(failed.sum()), "notes": [],
                                     "errors": int(g["error"].notna().sum())}
            if len(df):
                scores = score_qa(df, bertscore=cfg.evaluation.bertscore)
                entry.update(_agg_to_dict(scores.by_type), notes=list(scores.notes))
            else:
                entry.update(overall={}, by_type={})
            if judgments is not None:
                judged = _judge_summary(judgments[judgments["method"] == method], df)
                entry.update(judged)
                # headline numbers next to F1 in the report tables
                entry["overall"]["judge_accuracy"] = judged["judge"]["overall"].get("accuracy")
                for t, row in judged["judge"]["by_type"].items():
                    entry["by_type"].setdefault(t, {})["judge_accuracy"] = row.get("accuracy")
            out["qa"][method] = entry
    return out


def log_skipped(retrieval: dict[str, dict[str, Any]]) -> None:
    """One log line per level for the questions left out of the retrieval scores: every method is scored over the
    same questions, so their skip counts are the same and one line says it for all of them."""
    for level, methods in retrieval.items():
        skipped = next(iter(methods.values()), {}).get("skipped", {})
        if any(skipped.values()):
            log.info("retrieval eval (%s level): skipped %s", level, skipped)


#: How the turn-level table is computed (said in the report next to the table).
TURN_NOTE = ("turn level: sessions are ranked, then each ranked session is expanded into its turn pairs in order; "
             "this measures how much turn-level evidence the top sessions cover, not a ranking of turn pairs")


def _judge_summary(j: pd.DataFrame, answered: pd.DataFrame) -> dict[str, Any]:
    """Judge accuracy overall and per question type, from the run's judgments table."""
    from memgas.pipeline.evaluate.judge import aggregate_judge

    j = j[j["query_id"].isin(answered["query_id"])].copy()
    j["label"] = pd.Series([None if v is None or (isinstance(v, float) and math.isnan(v)) else bool(v)
                            for v in j["label"]], index=j.index, dtype=object)
    d = _agg_to_dict(aggregate_judge(j)) if len(j) else {"overall": {}, "by_type": {}}
    return {"judge": d, "judge_outputs": j[["query_id", "judge_output", "label", "error"]].astype(str).to_dict("records")}


def _turn_level(qinfo: pd.DataFrame, ranked_sessions: dict[str, list[str]], bank: Bank, cfg: MemgasConfig) -> dict | None:
    """Turn-level evidence (session_id:pair_index) scored against the turn pairs of ranked sessions.

    Sessions are ranked, not pairs; the turn ranking expands each ranked session into its pairs in order
    (the pairs of the best session first). This measures how much evidence text the top-K sessions cover.
    """
    has_turn = qinfo["evidence_turn_ids"].map(lambda v: v is not None and len(v) > 0)
    if not has_turn.any():
        return None
    # Arrow columns to Python lists, not pandas rows: a row tuple per session of the bank was most of this
    sessions = bank.read("sessions", columns=["history_id", "session_id", "text_hash"])
    last = bank.read("pairs", columns=["session_hash", "pair_index"]).group_by("session_hash").aggregate(
        [("pair_index", "max")])
    n_pairs = dict(zip(last["session_hash"].to_pylist(), (m + 1 for m in last["pair_index_max"].to_pylist())))
    sess_hash = dict(zip(zip(sessions["history_id"].to_pylist(), sessions["session_id"].to_pylist()),
                         sessions["text_hash"].to_pylist()))
    records = []
    for q, row in qinfo[has_turn].iterrows():
        turns: list[str] = []
        for s in ranked_sessions.get(q, [])[: max(cfg.evaluation.ks)]:
            turns += [f"{s}:{i}" for i in range(n_pairs.get(sess_hash.get((row.history_id, s)), 0))]
        records.append({"query_id": q, "ranked_ids": turns, "evidence_ids": list(row.evidence_turn_ids),
                        "is_abstention": bool(row.is_abstention), "question_type": row.question_type})
    per_q, skipped = score_retrieval(records, cfg.evaluation.ks, level="turn")
    return {**_agg_to_dict(aggregate_retrieval(per_q)), "n_evaluated": int(len(per_q)), "skipped": skipped}


# -- the run's accounting beside the metrics: LLM tokens per method, the planner's profiles, encoded texts --
#: JustMem methods that use the plans: ``justmem`` and ``justmem-compose`` retrieve with them (the profile, the
#: rewrites), and every card reader's answer prompt names the planner's operation (pipeline/justmem/read.py), so
#: they all pay the planner. ``cards`` reads sessions.
PLANNED_METHODS: tuple[str, ...] = ("justmem", "justmem-lookup", "justmem-compose", "justmem-replay")


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
    ``answer`` = the readers' answers of that method (prompt includes the filter step). LLM-free
    construction and planning count 0 tokens. Over the whole bank's sessions and questions (the same for every
    method of the run), answers over the questions read."""
    from memgas.pipeline.methods import uses_card_graph

    bank, cfg = ctx.bank, ctx.cfg
    zero = {"prompt": 0, "completion": 0}
    gen = zero
    both = uses_card_graph(cfg.retrieval.methods)  # memgas-cards reads the generations and the cards
    if (both or any(m in GENERATED_METHODS for m in cfg.retrieval.methods)) and bank.exists("generations"):
        model, version = generation_key(ctx)
        gen = _token_sums(bank.read("generations", ["prompt_tokens", "completion_tokens"],
                                    filter=(pc.field("model") == model) & (pc.field("prompt_version") == version)
                                    & pc.field("text_hash").isin(bank_session_hashes(ctx))))
    cards = plans = zero
    if justmem_enabled(cfg) or both:
        cards = _token_sums(session_cards(ctx)) if bank.exists("cards") else zero
        plans = _token_sums(current_plans(ctx))
    answers: dict[str, dict[str, int]] = {}
    if cfg.reading.enabled and ctx.results is not None:
        ans = current_answers(ctx)
        for m in set(ans["method"].to_pylist()):
            answers[m] = _token_sums(ans.filter(pc.field("method") == m))
    return charge_tokens(cfg.retrieval.methods, generations=gen, cards=cards, plans=plans, answers=answers)


def charge_tokens(methods: list[str], *, generations: dict[str, int], cards: dict[str, int], plans: dict[str, int],
                  answers: dict[str, dict[str, int]]) -> dict[str, dict[str, Any]]:
    """Each method's bill (``{prompt, completion}`` per step): the memory it reads (MemGAS's generations for
    :data:`GENERATED_METHODS`, the cards for JustMem's), the planner for :data:`PLANNED_METHODS`, and its own
    answers. Shared steps are charged in full to every method that uses them."""
    from memgas.pipeline.methods import get_method

    zero = {"prompt": 0, "completion": 0}
    out = {}
    for m in methods:
        jm = get_method(m).family == "justmem"
        construction = cards if jm else (generations if m in GENERATED_METHODS else zero)
        if get_method(m).family == "memgas-cards":
            construction = {k: generations[k] + cards[k] for k in generations}
        planner = plans if m in PLANNED_METHODS else zero
        out[m] = {"construction": construction, "planner": planner, "answer": answers.get(m, zero)}
    return out


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
    return {"card": set(session_cards(ctx)["text_hash"].to_pylist()), "plan rewrite": rewrites}


# -- evidence recall of what the reader receives --
#: How the reader's context is measured (metrics.json ``notes.reader_evidence``; said in the report).
READER_NOTE = ("reader's context: the utterances the answer model is given, per question, for every ranking method, "
               "rebuilt from the rankings and card picks by the reader's own functions (whether or not the LLM read "
               "it): session readers, the turns of the top reading.top_k sessions that fit the first step's window "
               "(the filter's when reading.filter; the filter's output is not measured; memgas-cards: each session's "
               "block with the cards that ranked it); card readers, the "
               "provenance spans of the cards that fit the answer prompt, and Replay's recovered turns. Tokens are "
               "counted by {counter} (the reader's own tokenizer may cut a context elsewhere); evidence = "
               "queries.evidence_utterance_ids (LoCoMo evidence dia_ids, LongMemEval has_answer turns); verbatim = "
               "evidence utterances whose own text is in the context (sessions, Replay's turns), not restated by a card")


class ApproxCounter:
    """A reader's token counter without its model: :func:`memgas.pipeline.models.openai_http.approx_tokens`
    (what the openai backend counts with when it has no tokenizer) over ``context_tokens``."""

    def __init__(self, context_tokens: int) -> None:
        self.context_tokens = context_tokens

    def count_tokens(self, text: str) -> int:
        from memgas.pipeline.models.openai_http import approx_tokens

        return approx_tokens(text)


def reader_evidence(ctx: StageContext, rankings: pa.Table, picks: pa.Table,
                    graph_picks: pa.Table | None = None) -> dict[str, dict[str, Any]]:
    """Per retrieval method, the evidence recall of the reader's context and its tokens
    (:mod:`memgas.pipeline.evaluate.evidence`; :data:`READER_NOTE` says what is measured): ``{method:
    {overall, by_type, n_evaluated, skipped, cut}}``, over every question of the bank. ``rankings``: the
    current rows of every method (MemGAS's, JustMem's and memgas-cards'); ``picks``: the current ``card_picks``;
    ``graph_picks``: the current ``card_graph_picks`` (memgas-cards' sessions carry their cards; None: without
    memgas-cards). Empty when the bank's queries were ingested before ``evidence_utterance_ids`` existed
    (re-ingest to measure)."""
    from memgas.pipeline.evaluate.evidence import aggregate_evidence, score_evidence
    from memgas.pipeline.methods import get_method, reads_cards

    bank, cfg = ctx.bank, ctx.cfg
    queries = bank.read("queries").to_pylist()
    if not queries or "evidence_utterance_ids" not in queries[0]:
        log.warning("evaluate: %s: the queries have no evidence_utterance_ids (ingested before the bank kept "
                    "evidence turns); re-ingest to measure the evidence recall of the reader's context", bank.path)
        return {}
    # a bank appended to after an ingest that kept no evidence turns: its old questions carry none (null;
    # the loaders write a list, empty where a question has none). Measure the others, and say how many are not.
    unmeasured = sum(q["evidence_utterance_ids"] is None for q in queries)
    if unmeasured == len(queries):
        log.warning("evaluate: %s: the queries have no evidence_utterance_ids (ingested before the bank kept "
                    "evidence turns); re-ingest to measure the evidence recall of the reader's context", bank.path)
        return {}
    if unmeasured:
        log.warning("evaluate: %s: %d of %d questions were ingested before the bank kept evidence turns "
                    "(no evidence_utterance_ids): "
                    "the evidence recall of the reader's context leaves them out; re-ingest to measure them all",
                    bank.path, unmeasured, len(queries))
        queries = [q for q in queries if q["evidence_utterance_ids"] is not None]
    qids = [q["query_id"] for q in queries]
    counter = ApproxCounter(cfg.llm.context_tokens)
    sessions = bank.read("sessions", ["history_id", "session_id", "text_hash"]).to_pylist()
    sids_of: dict[tuple[str, str], list[str]] = {}
    for s in sessions:
        sids_of.setdefault((s["history_id"], s["text_hash"]), []).append(s["session_id"])
    hash_of = {(s["history_id"], s["session_id"]): s["text_hash"] for s in sessions}
    top = rankings.filter(pc.field("rank") <= cfg.reading.top_k)
    # the turns of the sessions a session reader may be given (not the whole bank's: LongMemEval-M)
    hist = {q["query_id"]: q["history_id"] for q in queries}
    read = [(q, s) for m, q, s in zip(*top.select(["method", "query_id", "session_id"]).to_pydict().values())
            if not reads_cards(m)]
    turn_lengths = _turn_lengths(bank, sorted({hash_of[(hist[q], s)] for q, s in read if q in hist}))
    out: dict[str, dict[str, Any]] = {}
    for method in cfg.retrieval.methods:
        ranked = top.filter(pc.field("method") == method)
        if reads_cards(method):
            contexts = _card_contexts(ctx, ranked, picks, qids, method, counter, sids_of)
        else:
            mine = None
            if get_method(method).family == "memgas-cards" and graph_picks is not None:
                mine = graph_picks.filter((pc.field("method") == method) & (pc.field("rank") <= cfg.reading.top_k))
            contexts = _session_contexts(ctx, ranked, qids, counter, hash_of, turn_lengths, mine)
        records = [{"query_id": q["query_id"], "question_type": q["question_type"],
                    "is_abstention": q["is_abstention"], "evidence_ids": q["evidence_utterance_ids"] or [],
                    **contexts[q["query_id"]]} for q in queries]
        per_q, skipped = score_evidence(records)
        out[method] = {**_agg_to_dict(aggregate_evidence(per_q)), "n_evaluated": int(len(per_q)), "skipped": skipped,
                       "cut": sum(int(c["cut"]) for c in contexts.values()), "not_measured": unmeasured}
    return out


def _turn_lengths(bank: Bank, hashes: list[str]) -> dict[str, list[int]]:
    """{session_hash: characters of each rendered utterance, in turn order} of the sessions ``hashes`` (a
    session text is those lines joined by newlines)."""
    from memgas.pipeline.data.common import render_utterance

    out: dict[str, list[int]] = {}
    if not hashes:
        return out
    turns = bank.read("turns", ["session_hash", "turn_index", "role", "content"],
                      filter=pc.field("session_hash").isin(hashes)).sort_by(
        [("session_hash", "ascending"), ("turn_index", "ascending")])
    for h, role, content in zip(turns["session_hash"].to_pylist(), turns["role"].to_pylist(),
                                turns["content"].to_pylist()):
        out.setdefault(h, []).append(len(render_utterance(role, content)))
    return out


def _session_contexts(ctx: StageContext, ranked: pa.Table, qids: list[str], counter: ApproxCounter,
                      hash_of: dict[tuple[str, str], str], turn_lengths: dict[str, list[int]],
                      graph_picks: pa.Table | None = None) -> dict[str, dict]:
    """Per query, the session reader's first-step context (pipeline/read.py: ``reading_context``); with
    ``graph_picks`` (memgas-cards' reader), each session's block holds its picked cards
    (pipeline/card_graph_read.py). A card restates turns of its own session: the evidence in the context is
    that of the sessions' turns that fit."""
    from memgas.pipeline.card_graph_read import card_graph_reading_payloads
    from memgas.pipeline.read import context_turn_keys, reading_context, reading_payloads

    hist = {r["query_id"]: r["history_id"] for r in ctx.bank.read("queries", ["query_id", "history_id"]).to_pylist()}
    out = {}
    # the generations only where the report reads them under this config (a run whose ranked methods read no
    # summary leaves the generate stage without a reader: its rows may be another config's)
    key = generation_key(ctx) if tables.may_read(ctx, "generations") else None
    payloads = (reading_payloads(ctx.bank, ranked, qids, generation_key=key) if graph_picks is None else
                card_graph_reading_payloads(ctx.bank, ranked, graph_picks, qids, generation_key=key))
    for q in payloads:
        text, kept, cut = reading_context(counter, q, ctx.cfg.reading)
        lengths = [turn_lengths.get(hash_of[(hist[q["query_id"]], s["session_id"])], []) for s in q["sessions"]]
        keys = [f"{sid}:{t}" for sid, t in context_turn_keys(q["sessions"], text, kept, lengths)]
        out[q["query_id"]] = {"context_ids": keys, "verbatim_ids": keys, "context_tokens": counter.count_tokens(text),
                              "cut": cut}
    return out


def _card_contexts(ctx: StageContext, ranked: pa.Table, picks: pa.Table, qids: list[str], method: str,
                   counter: ApproxCounter, sids_of: dict[tuple[str, str], list[str]]) -> dict[str, dict]:
    """Per query, the card reader's answer prompt (pipeline/justmem/read.py: ``fit_cards``). A card's
    session text may stand at several positions of a history: its turns count for each of them."""
    from memgas.jobs import keys
    from memgas.pipeline.justmem.read import card_reading_payloads, fit_cards
    from memgas.pipeline.read import MARGIN

    cfg = ctx.cfg
    hist = {r["query_id"]: r["history_id"] for r in ctx.bank.read("queries", ["query_id", "history_id"]).to_pylist()}
    window = min(cfg.reading.context_tokens, counter.context_tokens) - cfg.reading.max_new_tokens - MARGIN
    payload = card_reading_payloads(ctx.bank, ranked, picks, qids, method=method, planner=keys.plan_key(ctx))
    out = {}
    for q in payload:
        fit = fit_cards(q, counter.count_tokens, window, cfg.justmem.replay_tokens)
        h = hist[q["query_id"]]

        def ids(pairs: list[tuple[str, int]]) -> list[str]:
            return [f"{sid}:{t}" for sh, t in pairs for sid in sids_of.get((h, sh), [])]

        out[q["query_id"]] = {"context_ids": ids(fit.turn_keys()), "verbatim_ids": ids(fit.verbatim_keys()),
                              "context_tokens": fit.context_tokens(counter.count_tokens), "cut": fit.cut}
    return out
