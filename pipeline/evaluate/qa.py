"""Lexical QA metrics: token F1 and exact match (SQuAD), BLEU-4, ROUGE-1/2/L, optional BERTScore.

References:
- SQuAD v1.1/v2.0 official evaluation script (Rajpurkar et al.): ``normalize_answer`` = lower case,
  drop punctuation, drop articles (a, an, the), collapse whitespace; token F1 = harmonic mean of token
  precision and recall over the multiset intersection of normalised tokens.
- BLEU-4 (Papineni et al., 2002) via sacrebleu (Post, 2018): sentence BLEU with sacrebleu's defaults
  (13a tokenisation, exponential smoothing, case-sensitive), on the raw strings; ``corpus_bleu4`` per group
  in the aggregate.
- ROUGE-1/2/L F-measure (Lin, 2004) via Google's ``rouge-score`` (Porter stemming on by default).
- BERTScore F1 (Zhang et al., 2020) only when the ``bert_score`` package is importable *and* its model is
  already on disk; otherwise the result carries a note and no BERTScore column. Not a dependency.

All scores are in [0, 1] (sacrebleu's 0-100 BLEU is divided by 100). Answers may be non-strings (LoCoMo has
integer answers): every hypothesis and answer goes through ``str()``; missing values become "".
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from memgas.pipeline.evaluate.categories import (
    is_adversarial,
    is_longmemeval_abstention,
    says_not_answerable,
)

if TYPE_CHECKING:  # imported where a table is built: importing the package (ingest, index) needs no pandas
    import pandas as pd

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS: tuple[str, ...] = ("query_id", "question_type", "hypothesis", "answer")
DEFAULT_BERTSCORE_MODEL = "roberta-large"  # bert_score's default for lang="en"

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def as_text(x: Any) -> str:
    """``str(x)``, with None / NaN -> "" (a missing answer is empty, not the word "nan")."""
    if x is None:
        return ""
    if isinstance(x, float) and np.isnan(x):
        return ""
    return str(x)


def normalize_answer(s: Any) -> str:
    """SQuAD normalisation: lower case, remove punctuation, remove articles, collapse whitespace.

    Order as in the SQuAD script: ``white_space_fix(remove_articles(remove_punc(lower(s))))``.
    """
    text = as_text(s).lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def token_f1(prediction: Any, ground_truth: Any) -> float:
    """SQuAD token F1: ``P = |common| / |pred|``, ``R = |common| / |gold|``, ``F1 = 2PR / (P + R)``.

    ``common`` is the multiset intersection of normalised tokens. Empty cases follow the SQuAD v2.0
    script: if either side normalises to no tokens, F1 = 1 when both are empty, else 0.
    """
    pred = normalize_answer(prediction).split()
    gold = normalize_answer(ground_truth).split()
    if not pred or not gold:
        return float(pred == gold)
    num_same = sum((Counter(pred) & Counter(gold)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred)
    recall = num_same / len(gold)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: Any, ground_truth: Any) -> float:
    """SQuAD exact match: 1.0 if the normalised strings are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def bleu4(hypothesis: Any, reference: Any) -> float:
    """Sentence BLEU-4 in [0, 1]: ``BP * exp(mean_{n=1..4} log p_n)`` via ``sacrebleu.sentence_bleu``.

    sacrebleu's sentence defaults apply (exponential smoothing of zero n-gram counts), so a short but
    correct answer is not scored 0 just for lacking 4-grams.
    """
    import sacrebleu

    return sacrebleu.sentence_bleu(as_text(hypothesis), [as_text(reference)]).score / 100.0


def corpus_bleu4(hypotheses: Sequence[Any], references: Sequence[Any]) -> float:
    """Corpus BLEU-4 in [0, 1] (n-gram counts pooled over the corpus before the geometric mean)."""
    import sacrebleu

    if not len(hypotheses):
        return float("nan")
    hyps = [as_text(h) for h in hypotheses]
    refs = [[as_text(r) for r in references]]
    return sacrebleu.corpus_bleu(hyps, refs).score / 100.0


def _rouge_scorer(use_stemmer: bool = True) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=use_stemmer)


def rouge_f(hypothesis: Any, reference: Any, use_stemmer: bool = True, scorer: Any = None) -> dict[str, float]:
    """ROUGE-1/2/L F-measures ``{"rouge1": .., "rouge2": .., "rougeL": ..}`` (rouge-score, target first)."""
    scorer = scorer or _rouge_scorer(use_stemmer)
    s = scorer.score(as_text(reference), as_text(hypothesis))
    return {name: float(v.fmeasure) for name, v in s.items()}


def bertscore_f1(
    hypotheses: Sequence[Any],
    references: Sequence[Any],
    model_type: str = DEFAULT_BERTSCORE_MODEL,
    num_layers: int | None = None,
) -> tuple[np.ndarray | None, str | None]:
    """BERTScore F1 per pair, or ``(None, note)`` when it cannot run here.

    Runs only if ``bert_score`` imports and ``model_type`` is a local directory or already in the Hugging
    Face cache: evaluation must never download a model or require one (the machines may be offline).
    """
    try:
        import bert_score  # noqa: F401  (optional, deliberately not a dependency)
    except ImportError:
        return None, "bertscore skipped: package bert_score is not installed"
    import os

    local = os.path.isdir(model_type)
    if not local:
        try:
            from huggingface_hub import try_to_load_from_cache

            local = isinstance(try_to_load_from_cache(model_type, "config.json"), str)
        except Exception as exc:  # noqa: BLE001 - any failure means "not available locally"
            logger.debug("HF cache probe failed for %s: %s", model_type, exc)
            local = False
    if not local:
        return None, f"bertscore skipped: model {model_type!r} is not available locally"
    try:
        _, _, f1 = bert_score.score(
            [as_text(h) for h in hypotheses],
            [as_text(r) for r in references],
            model_type=model_type,
            num_layers=num_layers,
            lang="en",
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - an optional metric must not sink the evaluation
        logger.warning("BERTScore failed: %s", exc)
        return None, f"bertscore skipped: {type(exc).__name__}: {exc}"
    return np.asarray(f1, dtype=np.float64), None


@dataclass
class QAScores:
    """Result of :func:`score_qa`: per-query table, aggregate table, and notes (e.g. skipped metrics)."""

    per_query: pd.DataFrame
    by_type: pd.DataFrame
    notes: list[str] = field(default_factory=list)


#: Columns averaged by :func:`aggregate_qa` when present.
QA_METRICS: tuple[str, ...] = (
    "f1",
    "exact_match",
    "bleu4",
    "rouge1",
    "rouge2",
    "rougeL",
    "bertscore_f1",
    "says_unanswerable",
    "abstention_correct",
)


def score_qa(
    df: pd.DataFrame,
    *,
    bertscore: bool = True,
    bertscore_model: str = DEFAULT_BERTSCORE_MODEL,
    rouge_stemmer: bool = True,
) -> QAScores:
    """Score every (hypothesis, answer) row of ``df`` and aggregate by ``question_type``.

    ``df`` needs query_id, question_type, hypothesis, answer; an ``is_abstention`` column is used when
    present. Per-query columns: f1, exact_match, bleu4, rouge1, rouge2, rougeL, bertscore_f1 (when it
    ran), ``says_unanswerable`` (the answer declines, :func:`categories.says_not_answerable`), ``abstention``
    (LongMemEval ``_abs`` id, ``is_abstention``, or LoCoMo adversarial type) and ``abstention_correct``
    (= says_unanswerable on abstention rows, NaN elsewhere; LoCoMo's category-5 accuracy).
    """
    import pandas as pd

    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise KeyError(f"score_qa: missing columns {missing}")
    notes: list[str] = []
    hyps = [as_text(h) for h in df["hypothesis"]]
    refs = [as_text(a) for a in df["answer"]]
    scorer = _rouge_scorer(rouge_stemmer)
    rouge = [rouge_f(h, r, scorer=scorer) for h, r in zip(hyps, refs)]

    out = pd.DataFrame(
        {
            "query_id": df["query_id"].astype(str).to_numpy(),
            "question_type": df["question_type"].astype(str).to_numpy(),
            "hypothesis": hyps,
            "answer": refs,
            "f1": [token_f1(h, r) for h, r in zip(hyps, refs)],
            "exact_match": [exact_match(h, r) for h, r in zip(hyps, refs)],
            "bleu4": [bleu4(h, r) for h, r in zip(hyps, refs)],
            "rouge1": [x["rouge1"] for x in rouge],
            "rouge2": [x["rouge2"] for x in rouge],
            "rougeL": [x["rougeL"] for x in rouge],
        }
    )
    if bertscore and len(out):
        f1, note = bertscore_f1(hyps, refs, model_type=bertscore_model)
        if f1 is not None:
            out["bertscore_f1"] = f1
        else:
            logger.info(note)
            notes.append(str(note))
    elif not bertscore:
        notes.append("bertscore skipped: disabled")

    flag = df["is_abstention"].fillna(False).astype(bool).to_numpy() if "is_abstention" in df.columns else None
    abst = np.array(
        [
            is_longmemeval_abstention(q) or is_adversarial(t) or (flag is not None and bool(flag[i]))
            for i, (q, t) in enumerate(zip(out["query_id"], out["question_type"]))
        ],
        dtype=bool,
    )
    declines = np.array([says_not_answerable(h) for h in hyps], dtype=np.float64)
    out["says_unanswerable"] = declines
    out["abstention"] = abst
    out["abstention_correct"] = np.where(abst, declines, np.nan)
    return QAScores(per_query=out, by_type=aggregate_qa(out), notes=notes)


def aggregate_qa(per_query: pd.DataFrame, by: str = "question_type") -> pd.DataFrame:
    """Means of the QA metric columns, first row ``"overall"``, then one row per ``by`` group.

    ``n`` = rows; ``n_abstention`` = abstention rows (``abstention_correct`` is averaged over those only);
    ``bleu4_corpus`` = corpus BLEU of the group when hypothesis/answer columns are present.
    """
    import pandas as pd

    metrics = [m for m in QA_METRICS if m in per_query.columns]

    def summarise(g: pd.DataFrame) -> dict[str, Any]:
        row: dict[str, Any] = {"n": len(g)}
        if "abstention" in g.columns:
            row["n_abstention"] = int(g["abstention"].sum())
        for m in metrics:
            vals = pd.to_numeric(g[m], errors="coerce")
            row[m] = float(vals.mean()) if vals.notna().any() else float("nan")
        if "hypothesis" in g.columns and "answer" in g.columns:
            row["bleu4_corpus"] = corpus_bleu4(list(g["hypothesis"]), list(g["answer"]))
        return row

    rows = {"overall": summarise(per_query)}
    if by in per_query.columns:
        for key, g in per_query.groupby(by, sort=True):
            rows[str(key)] = summarise(g)
    out = pd.DataFrame.from_dict(rows, orient="index")
    out.index.name = by
    return out


__all__ = [
    "QAScores",
    "aggregate_qa",
    "as_text",
    "bertscore_f1",
    "bleu4",
    "corpus_bleu4",
    "exact_match",
    "normalize_answer",
    "rouge_f",
    "score_qa",
    "token_f1",
]
