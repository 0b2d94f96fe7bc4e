"""Retrieval metrics: recall_any@K, recall_all@K and NDCG@K, as LongMemEval computes them.

Reference: LongMemEval (Wu et al., 2024), ``src/retrieval/eval_utils.py`` (repo xiaowu0162/LongMemEval):

- ``recall_any@K`` = 1 if at least one evidence id is among the top-K ranked ids, else 0.
- ``recall_all@K`` = 1 if every evidence id is among the top-K ranked ids, else 0. The MemGAS paper's
  "Recall@K" is this one.
- ``ndcg_any@K`` = DCG@K / IDCG@K with binary relevance and LongMemEval's discount
  ``DCG@K = rel_1 + sum_{i=2..K} rel_i / log2(i)`` (rank 1 and rank 2 both get weight 1);
  ``IDCG@K`` is the same sum over the ideal ranking, i.e. ``min(R, K)`` ones where R is the number of
  relevant ids (LongMemEval counts relevant ids present in the corpus; we count the distinct evidence ids,
  or those in ``corpus_ids`` when a record gives them -- identical on LongMemEval's data where every
  answer session is in the haystack). NDCG is 0 when IDCG is 0.
- ``ndcg@K`` (the standard one, Jarvelin & Kekalainen 2002, as in ranx / trec_eval) discounts rank i by
  ``1 / log2(i + 1)``. Reported alongside, and checked against ``ranx`` in the tests.

The same functions work at session level (ranked session ids, answer session ids) and at turn level
(ranked turn ids, turn ids marked ``has_answer``): only the ids differ; the ``level`` column says which.

Layout: array kernels over a boolean relevance matrix ``[Q, K]`` first (vectorised over queries), then
:func:`evaluate_retrieval` (one query, LongMemEval's signature in id form), :func:`score_retrieval`
(per-query DataFrame) and :func:`aggregate_retrieval` (means overall and by question type).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from memgas.pipeline.evaluate.categories import is_longmemeval_abstention

if TYPE_CHECKING:  # imported where a table is built: importing the package (ingest, index) needs no pandas
    import pandas as pd


#: The cut-offs reported everywhere (LongMemEval reports 5/10 at session level; the paper 1..10; 30/50 for
#: the reader's context budget).
DEFAULT_KS: tuple[int, ...] = (1, 3, 5, 10, 30, 50)

NdcgVariant = Literal["longmemeval", "standard"]

#: Skip reasons reported by :func:`score_retrieval`.
SKIP_ABSTENTION = "abstention"
SKIP_NO_EVIDENCE = "no_evidence"


# --------------------------------------------------------------------------------------------------------
# Array kernels
# --------------------------------------------------------------------------------------------------------


def _dedupe(ids: Iterable[Any]) -> list[str]:
    """Ids as strings, first occurrence kept. A ranking is a list of distinct ids; a repeated id would be
    counted twice by DCG and break ``hits == n_relevant`` for recall_all, so repeats are dropped."""
    seen: set[str] = set()
    out: list[str] = []
    for x in ids:
        s = str(x)
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def relevance_matrix(
    ranked_ids: Sequence[Sequence[Any]], evidence_ids: Sequence[Iterable[Any]], k: int
) -> np.ndarray:
    """Boolean ``[Q, k]`` matrix: ``rel[q, i]`` is True when the (i+1)-th ranked id of query q is evidence.

    Rankings shorter than k are padded with False (nothing retrieved there), as slicing ``rankings[:k]``
    does in the reference. Ids are compared as strings; repeated ranked ids are dropped (first kept).
    """
    if len(ranked_ids) != len(evidence_ids):
        raise ValueError(f"{len(ranked_ids)} rankings but {len(evidence_ids)} evidence lists")
    rel = np.zeros((len(ranked_ids), k), dtype=bool)
    for q, (ranked, ev) in enumerate(zip(ranked_ids, evidence_ids)):
        ev_set = {str(e) for e in ev}
        top = _dedupe(ranked)[:k]
        if top:
            rel[q, : len(top)] = [r in ev_set for r in top]
    return rel


def recall_any_at_k(rel: np.ndarray, k: int) -> np.ndarray:
    """``recall_any@k[q] = 1[ sum_{i<=k} rel[q, i] >= 1 ]``, float ``[Q]`` (LongMemEval ``recall_any``)."""
    return rel[:, :k].any(axis=1).astype(np.float64)


def recall_all_at_k(rel: np.ndarray, n_relevant: np.ndarray, k: int) -> np.ndarray:
    """``recall_all@k[q] = 1[ sum_{i<=k} rel[q, i] == R_q ]``, float ``[Q]`` (LongMemEval ``recall_all``).

    ``n_relevant`` [Q] is R_q, the number of distinct evidence ids. An evidence id that can never be
    retrieved (not in the corpus) keeps recall_all at 0, as ``all(doc in recalled ...)`` does. With
    R_q = 0 the reference's ``all([])`` is 1; such queries are skipped upstream anyway.
    """
    hits = rel[:, :k].sum(axis=1)
    return (hits >= np.asarray(n_relevant)).astype(np.float64)


def dcg_discounts(k: int, variant: NdcgVariant = "longmemeval") -> np.ndarray:
    """Per-rank DCG weights ``[k]`` for ranks i = 1..k.

    - ``"longmemeval"``: ``w_1 = 1``, ``w_i = 1 / log2(i)`` for i >= 2 (eval_utils.py ``dcg``).
    - ``"standard"``: ``w_i = 1 / log2(i + 1)`` (ranx, trec_eval).
    """
    ranks = np.arange(1, k + 1, dtype=np.float64)
    if variant == "longmemeval":
        w = np.ones(k, dtype=np.float64)
        w[1:] = 1.0 / np.log2(ranks[1:])
        return w
    if variant == "standard":
        return 1.0 / np.log2(ranks + 1.0)
    raise ValueError(f"unknown NDCG variant {variant!r}")


def dcg_at_k(rel: np.ndarray, k: int, variant: NdcgVariant = "longmemeval") -> np.ndarray:
    """``DCG@k[q] = sum_{i<=k} rel[q, i] * w_i`` with :func:`dcg_discounts` weights, float ``[Q]``."""
    kk = min(k, rel.shape[1])
    return rel[:, :kk].astype(np.float64) @ dcg_discounts(kk, variant)


def ideal_dcg_at_k(n_relevant: np.ndarray, k: int, variant: NdcgVariant = "longmemeval") -> np.ndarray:
    """``IDCG@k[q] = sum_{i <= min(R_q, k)} w_i``: binary relevance, all R_q relevant ids ranked first."""
    n = np.minimum(np.asarray(n_relevant, dtype=np.int64), k)
    cum = np.concatenate([[0.0], np.cumsum(dcg_discounts(k, variant))])
    return cum[n]


def ndcg_at_k(
    rel: np.ndarray, n_relevant: np.ndarray, k: int, variant: NdcgVariant = "longmemeval"
) -> np.ndarray:
    """``NDCG@k = DCG@k / IDCG@k``, 0 where IDCG is 0 (as the reference), float ``[Q]``."""
    dcg = dcg_at_k(rel, k, variant)
    idcg = ideal_dcg_at_k(n_relevant, k, variant)
    out = np.zeros_like(dcg)
    np.divide(dcg, idcg, out=out, where=idcg > 0)
    return out


# --------------------------------------------------------------------------------------------------------
# One query (LongMemEval's evaluate_retrieval, in id form)
# --------------------------------------------------------------------------------------------------------


def _n_relevant(evidence: Iterable[Any], corpus_ids: Iterable[Any] | None) -> int:
    ev = {str(e) for e in evidence}
    if corpus_ids is not None:
        ev &= {str(c) for c in corpus_ids}
    return len(ev)


def evaluate_retrieval(
    recalled_docs: Sequence[Any],
    correct_docs: Iterable[Any],
    k: int = 10,
    corpus_ids: Iterable[Any] | None = None,
) -> tuple[float, float, float]:
    """``(recall_any@k, recall_all@k, ndcg_any@k)`` for one query, LongMemEval semantics.

    LongMemEval's ``evaluate_retrieval(rankings, correct_docs, corpus_ids, k)`` takes indices into
    ``corpus_ids``; here ``recalled_docs`` are the ranked ids themselves. IDCG uses the distinct
    ``correct_docs`` (those in ``corpus_ids`` when given, as the reference does).
    """
    correct = list(correct_docs)
    rel = relevance_matrix([recalled_docs], [correct], k)
    n_rel_ndcg = np.array([_n_relevant(correct, corpus_ids)])
    # recall_all needs every correct doc (even one absent from the corpus) -> distinct count of all of them
    n_rel_all = np.array([len({str(c) for c in correct})])
    return (
        float(recall_any_at_k(rel, k)[0]),
        float(recall_all_at_k(rel, n_rel_all, k)[0]),
        float(ndcg_at_k(rel, n_rel_ndcg, k)[0]),
    )


# --------------------------------------------------------------------------------------------------------
# Many queries
# --------------------------------------------------------------------------------------------------------

_RANKED_KEYS = ("ranked_ids", "ranked", "rankings", "retrieved_ids")
_EVIDENCE_KEYS = ("evidence_ids", "evidence", "correct_ids", "answer_session_ids")


def _records(records: Any) -> list[dict[str, Any]]:
    """Normalise the input to a list of dicts: a DataFrame, a list of mappings, or {query_id: mapping}."""
    import pandas as pd

    if isinstance(records, pd.DataFrame):
        return records.to_dict(orient="records")
    if isinstance(records, Mapping):
        out = []
        for qid, rec in records.items():
            d = dict(rec)
            d.setdefault("query_id", qid)
            out.append(d)
        return out
    return [dict(r) for r in records]


def _truthy(x: Any) -> bool:
    if x is None or (isinstance(x, float) and np.isnan(x)):
        return False
    return bool(x)


def _get(rec: Mapping[str, Any], keys: Sequence[str], qid: Any) -> list[Any]:
    for key in keys:
        if key in rec and rec[key] is not None:
            v = rec[key]
            return [] if isinstance(v, float) and np.isnan(v) else list(v)
    raise KeyError(f"query {qid!r}: none of {keys} present")


def score_retrieval(
    records: Any,
    ks: Sequence[int] = DEFAULT_KS,
    *,
    level: str = "session",
    standard_ndcg: bool = True,
) -> tuple[pd.DataFrame, dict[str, int]]:
    """Per-query retrieval metrics for every K, and how many queries were skipped (by reason).

    ``records``: a DataFrame, a list of mappings or a ``{query_id: mapping}`` dict; each record has
    ``query_id``, ``ranked_ids`` (list[str], best first), ``evidence_ids`` (list[str]), ``is_abstention``
    (bool; also inferred from a ``_abs`` id suffix), ``question_type``, and optionally ``corpus_ids``.

    Skipped: abstention questions (``"abstention"``) and questions without evidence (``"no_evidence"``),
    as LongMemEval's retrieval evaluation does. The returned dict always has both keys (the caller logs it once per run, not once per
    method: every method is scored over the same questions).

    Columns: query_id, question_type, level, n_relevant, n_ranked, and for each K
    ``recall_any@K``, ``recall_all@K``, ``ndcg_any@K`` (LongMemEval discount) and, if ``standard_ndcg``,
    ``ndcg@K`` (log2(i+1) discount).
    """
    import pandas as pd

    recs = _records(records)
    skipped = {SKIP_ABSTENTION: 0, SKIP_NO_EVIDENCE: 0}
    keep_qid: list[str] = []
    keep_type: list[str] = []
    ranked: list[list[str]] = []
    evidence: list[list[str]] = []
    n_rel_ndcg: list[int] = []
    for rec in recs:
        qid = str(rec.get("query_id", rec.get("question_id")))
        flag = rec.get("is_abstention", False)
        # a missing flag (None/NaN from a joined table) is "not abstention", not bool(nan) == True
        abstention = _truthy(flag) or is_longmemeval_abstention(qid)
        if abstention:
            skipped[SKIP_ABSTENTION] += 1
            continue
        ev = [str(e) for e in _get(rec, _EVIDENCE_KEYS, qid)]
        if not ev:
            skipped[SKIP_NO_EVIDENCE] += 1
            continue
        keep_qid.append(qid)
        keep_type.append(str(rec.get("question_type", "")))
        ranked.append(_dedupe(_get(rec, _RANKED_KEYS, qid)))
        evidence.append(ev)
        corpus = rec.get("corpus_ids")
        if isinstance(corpus, float):  # NaN: column present but empty for this row
            corpus = None
        n_rel_ndcg.append(_n_relevant(ev, None if corpus is None else list(corpus)))
    ks = sorted({int(k) for k in ks})
    cols: dict[str, Any] = {
        "query_id": keep_qid,
        "question_type": keep_type,
        "level": [level] * len(keep_qid),
        "n_relevant": np.array([len(set(e)) for e in evidence], dtype=np.int64),
        "n_ranked": np.array([len(r) for r in ranked], dtype=np.int64),
    }
    if ks:
        rel = relevance_matrix(ranked, evidence, max(ks))
        n_all = cols["n_relevant"]
        n_ndcg = np.array(n_rel_ndcg, dtype=np.int64)
        for k in ks:
            cols[f"recall_any@{k}"] = recall_any_at_k(rel, k)
            cols[f"recall_all@{k}"] = recall_all_at_k(rel, n_all, k)
            cols[f"ndcg_any@{k}"] = ndcg_at_k(rel, n_ndcg, k, "longmemeval")
            if standard_ndcg:
                cols[f"ndcg@{k}"] = ndcg_at_k(rel, n_ndcg, k, "standard")
    return pd.DataFrame(cols), skipped


def metric_columns(df: pd.DataFrame) -> list[str]:
    """The ``name@K`` metric columns of a per-query table, in table order."""
    return [c for c in df.columns if "@" in c]


def aggregate_retrieval(per_query: pd.DataFrame, by: str = "question_type") -> pd.DataFrame:
    """Mean of every ``metric@K`` column, overall and per ``by`` group.

    Returns one row per group (index = group name, first row ``"overall"``) with an ``n`` column
    (queries averaged). Macro-averages over types are left to the report; LongMemEval reports the
    micro mean (``overall``).
    """
    return group_means(per_query, metric_columns(per_query), by)


def group_means(per_query: pd.DataFrame, cols: list[str], by: str) -> pd.DataFrame:
    """Means of ``cols`` (as float64), overall and per ``by`` group: index ``"overall"`` first, then the groups
    in sorted order, with an ``n`` column (queries averaged). Shared by every per-query metric table."""
    import pandas as pd

    values = per_query[cols].astype(np.float64)
    overall = values.mean().to_frame("overall").T if len(per_query) else pd.DataFrame(
        [[np.nan] * len(cols)], columns=cols, index=["overall"]
    )
    overall.insert(0, "n", len(per_query))
    if by in per_query.columns and len(per_query):
        grouped = values.groupby(per_query[by], sort=True).mean()
        grouped.insert(0, "n", per_query.groupby(by, sort=True).size())
        out = pd.concat([overall, grouped])
    else:
        out = overall
    out.index.name = by
    return out
