"""Retrieval metrics: hand-computed cases, parity with LongMemEval's eval_utils.py, ranx for standard NDCG."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pytest

from memgas.pipeline.evaluate import retrieval as ret
from memgas.pipeline.evaluate.retrieval import (
    DEFAULT_KS,
    aggregate_retrieval,
    dcg_discounts,
    evaluate_retrieval,
    ndcg_at_k,
    relevance_matrix,
    score_retrieval,
)

# ---------------------------------------------------------------------------------------------------------
# Oracle: a literal re-statement of LongMemEval src/retrieval/eval_utils.py (rankings are indices into
# corpus_ids). Only change: np.asfarray is gone in NumPy 2, so np.asarray(..., dtype=float).
# ---------------------------------------------------------------------------------------------------------


def lme_dcg(relevances, k):
    relevances = np.asarray(relevances, dtype=float)[:k]
    if relevances.size:
        return relevances[0] + np.sum(relevances[1:] / np.log2(np.arange(2, relevances.size + 1)))
    return 0.0


def lme_ndcg(rankings, correct_docs, corpus_ids, k=10):
    relevances = [1 if doc_id in correct_docs else 0 for doc_id in corpus_ids]
    sorted_relevances = [relevances[idx] for idx in rankings[:k]]
    ideal_relevance = sorted(relevances, reverse=True)
    ideal_dcg = lme_dcg(ideal_relevance, k)
    actual_dcg = lme_dcg(sorted_relevances, k)
    if ideal_dcg == 0:
        return 0.0
    return actual_dcg / ideal_dcg


def lme_evaluate_retrieval(rankings, correct_docs, corpus_ids, k=10):
    recalled_docs = set(corpus_ids[idx] for idx in rankings[:k])
    recall_any = float(any(doc in recalled_docs for doc in correct_docs))
    recall_all = float(all(doc in recalled_docs for doc in correct_docs))
    ndcg_score = lme_ndcg(rankings, correct_docs, corpus_ids, k)
    return recall_any, recall_all, ndcg_score


# ---------------------------------------------------------------------------------------------------------
# Hand-computed cases (expected values written from the formulas, not from the code)
# ---------------------------------------------------------------------------------------------------------

RANKED = ["s1", "s2", "s3", "s4", "s5"]
EVIDENCE = ["s2", "s4"]  # relevant at ranks 2 and 4, R = 2


def test_hand_case_k1() -> None:
    assert evaluate_retrieval(RANKED, EVIDENCE, k=1) == (0.0, 0.0, 0.0)


def test_hand_case_k3() -> None:
    ra, rall, nd = evaluate_retrieval(RANKED, EVIDENCE, k=3)
    assert (ra, rall) == (1.0, 0.0)
    # DCG = rel_2 / log2(2) = 1 ; IDCG = 1 + 1/log2(2) = 2
    assert nd == pytest.approx(1.0 / 2.0)


def test_hand_case_k5() -> None:
    ra, rall, nd = evaluate_retrieval(RANKED, EVIDENCE, k=5)
    assert (ra, rall) == (1.0, 1.0)
    # DCG = 1/log2(2) + 1/log2(4) = 1 + 0.5 = 1.5 ; IDCG = 2
    assert nd == pytest.approx(0.75)


def test_hand_case_standard_ndcg() -> None:
    rel = relevance_matrix([RANKED], [EVIDENCE], 5)
    # standard: DCG@5 = 1/log2(3) + 1/log2(5) ; IDCG = 1/log2(2) + 1/log2(3)
    expected5 = (1 / math.log2(3) + 1 / math.log2(5)) / (1 + 1 / math.log2(3))
    expected3 = (1 / math.log2(3)) / (1 + 1 / math.log2(3))
    assert ndcg_at_k(rel, np.array([2]), 5, "standard")[0] == pytest.approx(expected5)
    assert ndcg_at_k(rel, np.array([2]), 3, "standard")[0] == pytest.approx(expected3)
    assert expected5 == pytest.approx(0.650921, abs=1e-6)


def test_longmemeval_discount_quirk_rank2_counts_as_rank1() -> None:
    # rank 1 and rank 2 both weigh 1 in LongMemEval's DCG, so a single hit at rank 2 gives NDCG 1.0
    assert evaluate_retrieval(["x", "e"], ["e"], k=2)[2] == pytest.approx(1.0)
    rel = relevance_matrix([["x", "e"]], [["e"]], 2)
    assert ndcg_at_k(rel, np.array([1]), 2, "standard")[0] == pytest.approx(1 / math.log2(3))
    assert dcg_discounts(4).tolist() == pytest.approx([1.0, 1.0, 1 / math.log2(3), 0.5])
    assert dcg_discounts(3, "standard").tolist() == pytest.approx([1.0, 1 / math.log2(3), 0.5])


def test_partial_recall_and_ideal_from_all_relevant() -> None:
    # e3 is never retrieved: recall_all stays 0, and the ideal DCG still counts it (R = 3)
    ra, rall, nd = evaluate_retrieval(["e1", "n1", "e2"], ["e1", "e2", "e3"], k=3)
    assert (ra, rall) == (1.0, 0.0)
    # DCG = 1 + 0 + 1/log2(3) ; IDCG = 1 + 1 + 1/log2(3)
    assert nd == pytest.approx((1 + 1 / math.log2(3)) / (2 + 1 / math.log2(3)))


def test_short_ranking_and_miss() -> None:
    assert evaluate_retrieval(["x"], ["y"], k=10) == (0.0, 0.0, 0.0)
    assert evaluate_retrieval([], ["y"], k=5) == (0.0, 0.0, 0.0)
    # a short ranking that contains everything: all metrics 1 at any k
    assert evaluate_retrieval(["y"], ["y"], k=50) == (1.0, 1.0, 1.0)


def test_duplicate_ranked_ids_counted_once() -> None:
    rel = relevance_matrix([["e", "e", "f"]], [["e", "f"]], 3)
    assert rel.tolist() == [[True, True, False]]  # -> ["e", "f"] after dedupe


def test_relevance_matrix_vectorised() -> None:
    rel = relevance_matrix([["a", "b", "c"], ["c"], []], [["b"], ["c", "z"], ["a"]], 4)
    assert rel.shape == (3, 4)
    assert rel.tolist() == [
        [False, True, False, False],
        [True, False, False, False],
        [False, False, False, False],
    ]


# ---------------------------------------------------------------------------------------------------------
# score_retrieval / aggregate_retrieval
# ---------------------------------------------------------------------------------------------------------


def _records() -> list[dict]:
    return [
        {"query_id": "q1", "ranked_ids": RANKED, "evidence_ids": EVIDENCE, "is_abstention": False,
         "question_type": "multi-session"},
        {"query_id": "q2", "ranked_ids": ["a", "b"], "evidence_ids": ["a"], "is_abstention": False,
         "question_type": "single-session-user"},
        {"query_id": "q3_abs", "ranked_ids": ["a"], "evidence_ids": ["a"], "is_abstention": False,
         "question_type": "single-session-user"},
        {"query_id": "q4", "ranked_ids": ["a"], "evidence_ids": ["a"], "is_abstention": True,
         "question_type": "multi-session"},
        {"query_id": "q5", "ranked_ids": ["a"], "evidence_ids": [], "is_abstention": False,
         "question_type": "multi-session"},
    ]


def test_score_retrieval_skips_and_columns() -> None:
    df, skipped = score_retrieval(_records())
    assert skipped == {"abstention": 2, "no_evidence": 1}
    assert df["query_id"].tolist() == ["q1", "q2"]
    for k in DEFAULT_KS:
        for m in ("recall_any", "recall_all", "ndcg_any", "ndcg"):
            assert f"{m}@{k}" in df.columns
    q1 = df.iloc[0]
    assert q1["recall_all@3"] == 0.0 and q1["recall_all@5"] == 1.0
    assert q1["ndcg_any@3"] == pytest.approx(0.5) and q1["ndcg_any@5"] == pytest.approx(0.75)
    assert q1["n_relevant"] == 2 and q1["level"] == "session"


def test_score_retrieval_accepts_dict_and_dataframe() -> None:
    recs = _records()
    as_dict = {r["query_id"]: {k: v for k, v in r.items() if k != "query_id"} for r in recs}
    a, _ = score_retrieval(recs, ks=(1, 5))
    b, _ = score_retrieval(as_dict, ks=(1, 5))
    c, sk = score_retrieval(pd.DataFrame(recs), ks=(1, 5), level="turn")
    pd.testing.assert_frame_equal(a, b)
    pd.testing.assert_frame_equal(a.drop(columns="level"), c.drop(columns="level"))
    assert set(c["level"]) == {"turn"} and sk["no_evidence"] == 1


def test_aggregate_retrieval() -> None:
    df, _ = score_retrieval(_records(), ks=(1, 5))
    agg = aggregate_retrieval(df)
    assert agg.index.tolist() == ["overall", "multi-session", "single-session-user"]
    assert agg.loc["overall", "n"] == 2
    # q1: recall_all@1 = 0 ; q2: 1  -> mean 0.5
    assert agg.loc["overall", "recall_all@1"] == pytest.approx(0.5)
    assert agg.loc["multi-session", "recall_all@5"] == pytest.approx(1.0)
    assert agg.loc["multi-session", "ndcg_any@5"] == pytest.approx(0.75)
    assert agg.loc["single-session-user", "n"] == 1


def test_aggregate_empty() -> None:
    df, skipped = score_retrieval([_records()[2]], ks=(1,))
    assert len(df) == 0 and skipped["abstention"] == 1
    agg = aggregate_retrieval(df)
    assert agg.loc["overall", "n"] == 0


# ---------------------------------------------------------------------------------------------------------
# Parity with the LongMemEval oracle on random cases
# ---------------------------------------------------------------------------------------------------------


def _random_cases(n: int, seed: int = 0) -> list[tuple[list[str], list[str], list[int]]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        corpus = [f"sess_{i}" for i in range(rng.randint(1, 60))]
        rankings = list(range(len(corpus)))
        rng.shuffle(rankings)
        correct = rng.sample(corpus, rng.randint(1, min(4, len(corpus))))
        cases.append((corpus, correct, rankings))
    return cases


def test_parity_with_longmemeval_oracle() -> None:
    cases = _random_cases(200)
    records = [
        {"query_id": f"q{i}", "ranked_ids": [corpus[j] for j in rankings], "evidence_ids": correct,
         "is_abstention": False, "question_type": "t"}
        for i, (corpus, correct, rankings) in enumerate(cases)
    ]
    df, _ = score_retrieval(records, ks=DEFAULT_KS)
    for i, (corpus, correct, rankings) in enumerate(cases):
        for k in DEFAULT_KS:
            expected = lme_evaluate_retrieval(rankings, correct, corpus, k)
            ours = evaluate_retrieval([corpus[j] for j in rankings], correct, k)
            assert ours == pytest.approx(expected), (i, k)
            row = df.iloc[i]
            assert (row[f"recall_any@{k}"], row[f"recall_all@{k}"], row[f"ndcg_any@{k}"]) == pytest.approx(
                expected
            ), (i, k)


def test_parity_evidence_outside_corpus() -> None:
    # LongMemEval's IDCG counts only relevant docs present in the corpus; corpus_ids reproduces that
    corpus = ["a", "b", "c", "d"]
    rankings = [2, 0, 1, 3]
    correct = ["a", "zz"]
    for k in (1, 3, 5):
        expected = lme_evaluate_retrieval(rankings, correct, corpus, k)
        ours = evaluate_retrieval([corpus[j] for j in rankings], correct, k, corpus_ids=corpus)
        assert ours == pytest.approx(expected)


#: ranx's NDCG in a child process with numba's JIT off: the child runs ranx's own kernels as the Python they
#: are written in, so the oracle is still ranx's code, without the minute of numba compilation a fresh
#: environment spends on them (the suite runs on a fresh clone in CI, where numba's cache is always cold).
_RANX_CHILD = """
import json, sys
from ranx import Qrels, Run, evaluate
qrels, run, metrics = json.load(sys.stdin)
q = Qrels(qrels)
res = evaluate(q, Run(run), metrics, return_mean=False)
res = res if isinstance(res, dict) else {metrics[0]: res}
json.dump({"order": list(q.keys()), **{m: [float(x) for x in res[m]] for m in metrics}}, sys.stdout)
"""


def ranx_ndcg(records: Any, ks: Sequence[int] = DEFAULT_KS) -> pd.DataFrame:
    """Reference: standard NDCG@K per query computed by ``ranx`` (binary qrels), for cross-checking ``ndcg@K``.

    Scores given to ranx are strictly decreasing by rank so its sort reproduces our order. Abstention
    and no-evidence queries are dropped as in :func:`score_retrieval`. ranx runs in a child process with
    ``NUMBA_DISABLE_JIT=1`` (:data:`_RANX_CHILD`).
    """
    per_query, _ = score_retrieval(records, ks=(), standard_ndcg=False)
    keep = set(per_query["query_id"])
    qrels: dict[str, dict[str, int]] = {}
    run: dict[str, dict[str, float]] = {}
    for rec in ret._records(records):
        qid = str(rec.get("query_id", rec.get("question_id")))
        if qid not in keep:
            continue
        qrels[qid] = {str(e): 1 for e in ret._get(rec, ret._EVIDENCE_KEYS, qid)}
        ranked = ret._dedupe(ret._get(rec, ret._RANKED_KEYS, qid))
        # ranx drops queries whose run is empty; a placeholder miss keeps NDCG = 0 for them.
        run[qid] = {d: float(len(ranked) - i) for i, d in enumerate(ranked)} or {"__none__": 0.0}
    metrics = [f"ndcg@{int(k)}" for k in sorted({int(k) for k in ks})]
    if not qrels:
        return pd.DataFrame(columns=["query_id", *metrics])
    child = subprocess.run([sys.executable, "-c", _RANX_CHILD], input=json.dumps([qrels, run, metrics]),
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "NUMBA_DISABLE_JIT": "1"})
    assert child.returncode == 0, child.stderr[-3000:]
    res = json.loads(child.stdout)
    # ranx sorts query ids internally; map back by the Qrels' key order
    df = pd.DataFrame({"query_id": res["order"], **{m: np.asarray(res[m], dtype=np.float64) for m in metrics}})
    return df.set_index("query_id").loc[list(qrels)].reset_index()


def test_standard_ndcg_matches_ranx() -> None:
    cases = _random_cases(40, seed=1)
    records = [
        {"query_id": f"q{i:03d}", "ranked_ids": [corpus[j] for j in rankings][:30], "evidence_ids": correct,
         "is_abstention": False, "question_type": "t"}
        for i, (corpus, correct, rankings) in enumerate(cases)
    ]
    ks = (1, 3, 5, 10)
    ours, _ = score_retrieval(records, ks=ks)
    ref = ranx_ndcg(records, ks=ks)
    assert ref["query_id"].tolist() == ours["query_id"].tolist()
    for k in ks:
        np.testing.assert_allclose(ours[f"ndcg@{k}"].to_numpy(), ref[f"ndcg@{k}"].to_numpy(), atol=1e-9)


def test_arrow_style_inputs() -> None:
    # columns read back from Parquet give numpy arrays per cell and NaN/None for missing flags
    df = pd.DataFrame(
        {
            "query_id": ["q1", "q2"],
            "ranked_ids": [np.array(RANKED), np.array(["a"])],
            "evidence_ids": [np.array(EVIDENCE), np.array([], dtype=str)],
            "is_abstention": [np.nan, None],
            "question_type": ["multi-session", "multi-session"],
        }
    )
    out, skipped = score_retrieval(df, ks=(5,))
    assert out["query_id"].tolist() == ["q1"] and skipped == {"abstention": 0, "no_evidence": 1}
    assert out.loc[0, "ndcg_any@5"] == pytest.approx(0.75)
