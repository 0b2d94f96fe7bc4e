"""The evaluate report: retrieval and QA metrics of the run."""

from __future__ import annotations

import logging
from typing import Any

from memgas.jobs import tables
from memgas.jobs.stage import Active, Report, StageContext
from memgas.jobs.stages.rank import ranking_latency

log = logging.getLogger(__name__)


#: the rankings of every family's methods (the last table of each written before the report)
RANKINGS = tuple(tables.ranking(f) for f in ("memgas", "justmem", "memgas-cards"))
#: the latency probe (:func:`memgas.jobs.stages.rank.ranking_latency`): the method it ranks with and what it reads
PROBE_METHOD = "memgas"
PROBED = ("nodes", "node_vectors", "edges")


class EvaluateReport(Report):
    """Retrieval metrics per method (session and turn level), QA metrics and judge accuracy -> metrics, over
    the current rows of every ranking, answer and judgment table."""

    name = "evaluate"
    # and what the readers read, to rebuild their contexts (evidence recall of the reader's context)
    reads = ("queries", *RANKINGS, "answers", "card_answers", "card_graph_answers", "judgments", "sessions", "pairs",
             "texts", "turns", "generations", "card_picks", "card_graph_picks", "cards", "plans", *PROBED)
    # the reading budgets shape the readers' contexts it rebuilds (justmem.replay_tokens too, declared by
    # card-read only: without JustMem that field changes nothing)
    fields = ("evaluation.ks", "evaluation.bertscore", "reading.top_k", "reading.filter", "reading.context_tokens",
              "reading.max_new_tokens", "llm.context_tokens")

    def active(self, ctx: StageContext) -> Active:
        from memgas.jobs.stages.card_graph_read import card_graph_read_enabled
        from memgas.pipeline.methods import get_method, uses_card_graph

        methods = ctx.cfg.retrieval.methods
        both = uses_card_graph(methods)
        # memgas-cards' rankings and picks are read only where it is ranked, its answers where it is read: other
        # configs keep their fingerprint; the generations only with a MemGAS method (their tokens charged to the
        # methods that read them, evaluate_run.method_tokens; the summaries in a session reader's context,
        # reader_evidence), so a JustMem-only run leaves MemGAS's generate stage without a reader
        # (runner.unused_stages)
        drop = set() if both else {tables.ranking("memgas-cards"), "card_graph_picks"}
        if not card_graph_read_enabled(ctx.cfg):
            drop.add("card_graph_answers")
        if not both and not any(get_method(m).family == "memgas" for m in methods):
            drop.add("generations")
        if PROBE_METHOD not in methods:  # the latency probe ranks with the memgas method's graph
            drop.update(PROBED)
        return Active(reads=tuple(t for t in self.reads if t not in drop)) if drop else Active()

    def report(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.jobs.evaluate_run import evaluate_run
        from memgas.jobs.stages.read import ANSWER_TABLES

        reads = tables.declared_reads(ctx, self, self.active(ctx))
        ranked = [t for t in (tables.resolve(ctx, r, self) for r in RANKINGS) if t in reads]
        parts = {"rankings": [p for t in ranked for p in tables.current_parts(ctx, t)],
                 "answers": [p for t in ANSWER_TABLES if t in reads for p in tables.current_parts(ctx, t)],
                 "judgments": tables.current_parts(ctx, "judgments")}
        metrics = evaluate_run(ctx.cfg, ctx.bank, ctx.results, parts={k: sorted(v) for k, v in parts.items()})
        add_reader_evidence(ctx, metrics, sorted(parts["rankings"]))
        return {"items": metrics.get("n_queries", 0), "metrics": metrics, "results": run_results(ctx)}


def run_results(ctx: StageContext) -> dict[str, Any]:
    """What metrics.json says beside the evaluation: the association's settings and the answers written
    (``run``), the texts encoded (``encoding``), each method's LLM tokens (``tokens``), the planner's profiles
    (``profiles``) and latencies (``latency``)."""
    from memgas.jobs.evaluate_run import justmem_text_groups, method_tokens, plan_profiles
    from memgas.jobs.keys import accounting_keys
    from memgas.jobs.profiling import percentiles_ms
    from memgas.jobs.history_index.ivf_units import association_info
    from memgas.pipeline.encode import encoding_accounting

    with tables.unguarded(ctx):
        # what the index holds, over every table a config's encoders wrote (the bank's accounting, not a
        # function of this config's inputs: no fingerprint hashes it, a report writes no table)
        encoding = encoding_accounting(ctx.bank, **accounting_keys(ctx), extra=justmem_text_groups(ctx))
        association = association_info(ctx)
    answers = [s for s, _ in tables.writers(ctx, "answers")]
    latency = {}
    try:
        probed = ranking_latency(ctx, n_queries=200 if ctx.profile else 30, method=PROBE_METHOD)
        latency = {f"ranking ({PROBE_METHOD}, 1 query)": probed}
    except Exception as exc:  # the probe is informative only; never fail a run over it
        log.warning("latency probe failed: %s", exc)
    # the readers' per-query latency (their units are batches of queries; the first is the warm-up)
    per_query = [sec / n for s in answers for n, sec in ctx.unit_seconds.get(s.name, [])[1:] if n]
    if per_query:
        latency[f"reading (filter+answer, {ctx.cfg.llm.batch_size} query/batch)"] = percentiles_ms(per_query)
    return {"run": {"association": association,
                    "answered": sum(int(ctx.stats.get(s.name, {}).get("answers", 0)) for s in answers)},
            "encoding": encoding, "tokens": method_tokens(ctx), "profiles": plan_profiles(ctx), "latency": latency}


def add_reader_evidence(ctx: StageContext, metrics: dict[str, Any], ranking_parts: list[str]) -> None:
    """``retrieval.session[method].reader``: the evidence recall of the reader's context and its tokens,
    beside the method's R_all and NDCG (:func:`memgas.jobs.evaluate_run.reader_evidence`)."""
    from memgas.jobs.evaluate_run import READER_NOTE, reader_evidence
    from memgas.jobs.stages.justmem import justmem_enabled
    from memgas.pipeline.schema import CARD_PICKS, RANKINGS

    if ctx.results is None:
        return
    rankings = ctx.results.read("rankings", parts=ranking_parts) if ranking_parts else RANKINGS.empty_table()
    picks = tables.read_current(ctx, "card_picks") if justmem_enabled(ctx.cfg) else CARD_PICKS.empty_table()
    graph_picks = tables.read_current(ctx, "card_graph_picks") if tables.may_read(ctx, "card_graph_picks") else None
    evidence = reader_evidence(ctx, rankings, picks, graph_picks)
    session = metrics.get("retrieval", {}).get("session", {})
    for method, entry in evidence.items():
        if method in session:
            session[method]["reader"] = entry
    if evidence:
        metrics.setdefault("notes", {})["reader_evidence"] = READER_NOTE.format(counter="approx_tokens (4 characters "
                                                                                 "a token) within min(reading."
                                                                                 "context_tokens, llm.context_tokens)")
