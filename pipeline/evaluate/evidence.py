"""Evidence recall of the reader's context: how much of a question's evidence the answer model is given.

Retrieval metrics (:mod:`.retrieval`) score a ranking of sessions; this module scores what the reader puts in
front of the answer model, in utterances (``turns.turn_index``, keys ``"session_id:turn_index"``, the
``queries.evidence_utterance_ids`` that ingest keeps: LoCoMo's ``evidence`` dia_ids, LongMemEval's
``has_answer`` turns). Per question q with evidence utterances E_q (distinct) and context utterances C_q:

- ``evidence_recall[q] = |E_q ∩ C_q| / |E_q|`` (the share of evidence utterances in the context);
- ``evidence_all[q] = 1[E_q ⊆ C_q]`` (every evidence utterance is there: the analogue of recall_all);
- ``evidence_verbatim[q] = |E_q ∩ V_q| / |E_q|`` where V_q ⊆ C_q are the utterances whose own words are in
  the context (a MemGAS session's turns; Replay's recovered turns), as opposed to an utterance a card
  restates (a card's provenance span);
- ``context_tokens[q]``: tokens of the context (the caller's counter).

What C_q, V_q and the tokens are for each method is the caller's (``jobs/evaluate_run.py: reader_evidence``,
from the functions that build the reading context). Questions are skipped as in retrieval: abstention
questions and questions without utterance-level evidence; means are over the evaluated questions.

Layout as :mod:`.retrieval`: an array kernel (:func:`evidence_hits`, :func:`evidence_recall`,
:func:`evidence_all`), :func:`score_evidence` (per-query DataFrame) and :func:`aggregate_evidence` (means,
overall and by question type). The oracle test checks the mean recall against scikit-learn's sample-averaged
multilabel recall.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from memgas.pipeline.evaluate.categories import is_longmemeval_abstention
from memgas.pipeline.evaluate.retrieval import SKIP_ABSTENTION, SKIP_NO_EVIDENCE, group_means

if TYPE_CHECKING:  # imported where a table is built: importing the package (ingest, index) needs no pandas
    import pandas as pd

#: The per-query metric columns, in report order.
EVIDENCE_METRICS: tuple[str, ...] = ("evidence_recall", "evidence_all", "evidence_verbatim", "context_tokens")


def evidence_hits(context: Sequence[Iterable[Any]], evidence: Sequence[Iterable[Any]]) -> tuple[np.ndarray, np.ndarray]:
    """``(hits [Q], n_evidence [Q])``: distinct evidence ids of each query found in its context, and their
    number. Ids are compared as strings."""
    if len(context) != len(evidence):
        raise ValueError(f"{len(context)} contexts but {len(evidence)} evidence lists")
    hits = np.zeros(len(evidence), dtype=np.int64)
    n = np.zeros(len(evidence), dtype=np.int64)
    for q, (ctx, ev) in enumerate(zip(context, evidence)):
        ev_set = {str(e) for e in ev}
        hits[q] = len(ev_set & {str(c) for c in ctx})
        n[q] = len(ev_set)
    return hits, n


def evidence_recall(hits: np.ndarray, n_evidence: np.ndarray) -> np.ndarray:
    """``hits / n_evidence``, float ``[Q]``; NaN where a query has no evidence."""
    n = np.asarray(n_evidence, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, np.asarray(hits, dtype=np.float64) / np.where(n > 0, n, 1.0), np.nan)


def evidence_all(hits: np.ndarray, n_evidence: np.ndarray) -> np.ndarray:
    """``1[hits == n_evidence]``, float ``[Q]``; NaN where a query has no evidence."""
    n = np.asarray(n_evidence)
    return np.where(n > 0, (np.asarray(hits) >= n).astype(np.float64), np.nan)


def score_evidence(records: Iterable[dict[str, Any]]) -> tuple[pd.DataFrame, dict[str, int]]:
    """Per-query evidence metrics, and how many queries were skipped (``abstention``, ``no_evidence``).

    Each record: ``query_id``, ``question_type``, ``is_abstention``, ``evidence_ids`` (the evidence
    utterances), ``context_ids`` (utterances in the reader's context), ``verbatim_ids`` (those of them whose
    own text is there; a subset of ``context_ids``), ``context_tokens`` (int). Columns: query_id,
    question_type, n_evidence and :data:`EVIDENCE_METRICS`.
    """
    import pandas as pd

    skipped = {SKIP_ABSTENTION: 0, SKIP_NO_EVIDENCE: 0}
    kept: list[dict[str, Any]] = []
    for rec in records:
        qid = str(rec["query_id"])
        if bool(rec.get("is_abstention") or False) or is_longmemeval_abstention(qid):
            skipped[SKIP_ABSTENTION] += 1
        elif not list(rec.get("evidence_ids") or []):
            skipped[SKIP_NO_EVIDENCE] += 1
        else:
            kept.append(rec)
    evidence = [list(r["evidence_ids"]) for r in kept]
    hits, n = evidence_hits([list(r.get("context_ids") or []) for r in kept], evidence)
    vhits, _ = evidence_hits([list(r.get("verbatim_ids") or []) for r in kept], evidence)
    df = pd.DataFrame({
        "query_id": [str(r["query_id"]) for r in kept],
        "question_type": [str(r.get("question_type", "")) for r in kept],
        "n_evidence": n,
        "evidence_recall": evidence_recall(hits, n),
        "evidence_all": evidence_all(hits, n),
        "evidence_verbatim": evidence_recall(vhits, n),
        "context_tokens": np.array([int(r.get("context_tokens") or 0) for r in kept], dtype=np.int64),
    })
    return df, skipped


def aggregate_evidence(per_query: pd.DataFrame, by: str = "question_type") -> pd.DataFrame:
    """Means of :data:`EVIDENCE_METRICS`, overall and per ``by`` group (index ``"overall"`` first, then the
    groups), with an ``n`` column (queries averaged)."""
    return group_means(per_query, list(EVIDENCE_METRICS), by)
