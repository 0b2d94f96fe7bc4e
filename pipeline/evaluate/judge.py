"""LLM-as-judge QA accuracy with LongMemEval's per-question-type instructions.

Reference: LongMemEval (Wu et al., 2024), ``src/evaluation/evaluate_qa.py``, ``get_anscheck_prompt``. The
judge sees the question, the gold answer (a rubric for preference questions, an explanation for abstention
questions) and the model's response, and answers yes/no:

- single-session-user / single-session-assistant / multi-session: yes if the response contains the correct
  answer, is equivalent to it, or contains all intermediate steps; a subset of the information is no.
- temporal-reasoning: the same, plus off-by-one errors in day/week/month counts are not penalised.
- knowledge-update: yes if the updated answer is present, even alongside the old information.
- single-session-preference: yes if the response satisfies the rubric, i.e. recalls and uses the user's
  personal information correctly (not every rubric point is needed).
- abstention (``_abs`` ids): yes if the response identifies the question as unanswerable.

The wording is kept as in the reference so accuracies stay comparable with published numbers. LoCoMo
questions use the single-session-user template; LoCoMo category 5 (adversarial) is scored by the
deterministic rule of :func:`categories.adversarial_correct` unless ``adversarial="judge"``, which sends it
through the abstention template instead.

Differences from the reference, both deliberate: prompts go out as one batched ``LLM.generate`` call; and
the verdict is the *first* yes/no word (``parse_yes_no``) rather than ``'yes' in response.lower()``, which
counts "no, not yes" as yes. Outputs with no yes/no word are ``None`` (unparseable) and counted apart.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from memgas.pipeline.evaluate.categories import (
    LOCOMO_CATEGORIES,
    adversarial_correct,
    is_adversarial,
    is_longmemeval_abstention,
)
from memgas.pipeline.evaluate.qa import as_text
from memgas.pipeline.llm_calls import SURROGATE_RE
from memgas.pipeline.models.base import LLM, ChatPrompt, SamplingParams

if TYPE_CHECKING:  # imported where a table is built: importing the package (ingest, index) needs no pandas
    import pandas as pd

logger = logging.getLogger(__name__)

#: Bump when any template text changes, so cached judge outputs are not reused across versions.
JUDGE_PROMPT_VERSION = "longmemeval-v1"

#: LongMemEval's judge call: greedy, 10 new tokens.
DEFAULT_JUDGE_PARAMS = SamplingParams(max_tokens=10, temperature=0.0)

# ---- templates (the one place they live) ---------------------------------------------------------------
# Built from shared sentences; the assembled strings equal the reference's, including its whitespace
# (a space before the first blank line in three of them).
_INTRO = (
    "I will give you a question, a correct answer, and a response from a model. "
    "Please answer yes if the response contains the correct answer. Otherwise, answer no."
)
_STEPS = (
    " If the response is equivalent to the correct answer or contains all the intermediate steps to get the "
    "correct answer, you should also answer yes. If the response only contains a subset of the information "
    "required by the answer, answer no."
)
_OFF_BY_ONE = (
    " In addition, do not penalize off-by-one errors for the number of days. If the question asks for the "
    "number of days/weeks/months, etc., and the model makes off-by-one errors (e.g., predicting 19 days when "
    "the answer is 18), the model's response is still correct."
)
_UPDATE = (
    " If the response contains some previous information along with an updated answer, the response should "
    "be considered as correct as long as the updated answer is the required answer."
)
_ASK = "\n\nIs the model response correct? Answer yes or no only."
_QA = "\n\nQuestion: {question}\n\nCorrect Answer: {answer}\n\nModel Response: {response}" + _ASK

_FACTUAL = _INTRO + _STEPS + " " + _QA
_TEMPORAL = _INTRO + _STEPS + _OFF_BY_ONE + " " + _QA
_KNOWLEDGE_UPDATE = _INTRO + _UPDATE + _QA
_PREFERENCE = (
    "I will give you a question, a rubric for desired personalized response, and a response from a model. "
    "Please answer yes if the response satisfies the desired response. Otherwise, answer no. The model does "
    "not need to reflect all the points in the rubric. The response is correct as long as it recalls and "
    "utilizes the user's personal information correctly."
    "\n\nQuestion: {question}\n\nRubric: {answer}\n\nModel Response: {response}" + _ASK
)
_ABSTENTION = (
    "I will give you an unanswerable question, an explanation, and a response from a model. Please answer "
    "yes if the model correctly identifies the question as unanswerable. The model could say that the "
    "information is incomplete, or some other information is given but the asked information is not."
    "\n\nQuestion: {question}\n\nExplanation: {answer}\n\nModel Response: {response}"
    "\n\nDoes the model correctly identify the question as unanswerable? Answer yes or no only."
)

ABSTENTION_KEY = "abstention"
DEFAULT_KEY = "single-session-user"

#: Template per key; keys are LongMemEval question types plus ``"abstention"``.
JUDGE_TEMPLATES: Mapping[str, str] = MappingProxyType(
    {
        "single-session-user": _FACTUAL,
        "single-session-assistant": _FACTUAL,
        "multi-session": _FACTUAL,
        "temporal-reasoning": _TEMPORAL,
        "knowledge-update": _KNOWLEDGE_UPDATE,
        "single-session-preference": _PREFERENCE,
        ABSTENTION_KEY: _ABSTENTION,
    }
)

#: Digest of every judge template and the sampling parameters: keys the judge stage, so an edited template
#: re-judges even when nobody bumps JUDGE_PROMPT_VERSION.
JUDGE_PROMPT_DIGEST = hashlib.blake2b(
    repr([JUDGE_PROMPT_VERSION, sorted(JUDGE_TEMPLATES.items()), DEFAULT_JUDGE_PARAMS]).encode(), digest_size=8
).hexdigest()

_warned_types: set[str] = set()


def template_key(question_type: str, abstention: bool = False) -> str:
    """Which template judges this question: ``"abstention"`` for abstention questions, the LongMemEval
    type's own template, and the single-session-user one for LoCoMo categories and anything unknown."""
    if abstention:
        return ABSTENTION_KEY
    qt = str(question_type)
    if qt in JUDGE_TEMPLATES:
        return qt
    if qt not in LOCOMO_CATEGORIES.values() and qt not in _warned_types:
        # The reference raises NotImplementedError here; we judge with the generic factual template.
        _warned_types.add(qt)
        logger.warning("judge: unknown question_type %r, using the %s template", qt, DEFAULT_KEY)
    return DEFAULT_KEY


def judge_prompt(
    question_type: str, question: Any, answer: Any, hypothesis: Any, *, abstention: bool = False
) -> str:
    """The judge prompt for one question (LongMemEval ``get_anscheck_prompt``); values go through ``str()``."""
    return JUDGE_TEMPLATES[template_key(question_type, abstention)].format(
        question=as_text(question), answer=as_text(answer), response=as_text(hypothesis)
    )


_YES_NO_RE = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def parse_yes_no(text: Any) -> bool | None:
    """The judge's verdict: True for yes, False for no, None when no yes/no word is found.

    Takes the first standalone "yes" or "no" (case-insensitive, punctuation and markdown tolerated:
    "Yes.", "**yes**", "The answer is yes", "NO,"). Reasoning in ``<think>...</think>`` is ignored, and so
    is everything before the last ``</think>`` of an unbalanced block. "not", "nope", "yesterday" are not
    verdicts.
    """
    if text is None:
        return None
    s = str(text)
    # everything up to the last </think> is reasoning (no closed <think> block is left after it, so no
    # regex over <think>...</think> pairs: that rescans to the end from every unclosed tag, quadratic)
    if "</think>" in s.lower():
        s = s[s.lower().rfind("</think>") + len("</think>") :]
    m = _YES_NO_RE.search(s)
    if m is None:
        return None
    return m.group(1).lower() == "yes"


def _abstention_flags(df: pd.DataFrame) -> np.ndarray:
    flags = np.array([is_longmemeval_abstention(q) for q in df["query_id"].astype(str)], dtype=bool)
    if "is_abstention" in df.columns:
        flags |= df["is_abstention"].fillna(False).astype(bool).to_numpy()
    return flags


def run_judge(
    llm: LLM,
    df: pd.DataFrame,
    params: SamplingParams | None = None,
    *,
    adversarial: Literal["rule", "judge"] = "rule",
) -> pd.DataFrame:
    """Judge every row of ``df`` (query_id, question_type, question, answer, hypothesis[, is_abstention]).

    All LLM prompts go out in one ``llm.generate`` call (single user message each, as the reference).
    LoCoMo adversarial rows (question_type "adversarial" or 5) are scored by
    :func:`categories.adversarial_correct` when ``adversarial="rule"`` (no LLM call), else judged with the
    abstention template. A per-item generation error gives label None and the error text, never an
    exception.

    Returns query_id, question_type, template, judge_prompt, judge_output, label (True/False/None),
    error (str/None), method ("llm" or "rule"), in input order.
    """
    import pandas as pd

    missing = [c for c in ("query_id", "question_type", "question", "answer", "hypothesis") if c not in df.columns]
    if missing:
        raise KeyError(f"run_judge: missing columns {missing}")
    if adversarial not in ("rule", "judge"):
        raise ValueError(f"adversarial must be 'rule' or 'judge', got {adversarial!r}")
    params = params or DEFAULT_JUDGE_PARAMS
    abst = _abstention_flags(df)
    qtypes = [str(t) for t in df["question_type"]]
    adv = np.array([is_adversarial(t) for t in qtypes], dtype=bool)
    rule = adv & (adversarial == "rule")
    abst = abst | (adv & (adversarial == "judge"))

    rows: list[dict[str, Any]] = []
    prompts: list[ChatPrompt] = []
    prompt_rows: list[int] = []
    for i, rec in enumerate(df[["query_id", "question", "answer", "hypothesis"]].itertuples(index=False)):
        row: dict[str, Any] = {
            "query_id": str(rec.query_id),
            "question_type": qtypes[i],
            "template": "",
            "judge_prompt": "",
            "judge_output": "",
            "label": None,
            "error": None,
            "method": "llm",
        }
        if rule[i]:
            row.update(method="rule", template="adversarial-rule", label=adversarial_correct(rec.hypothesis))
        else:
            key = template_key(qtypes[i], bool(abst[i]))
            text = judge_prompt(qtypes[i], rec.question, rec.answer, rec.hypothesis, abstention=bool(abst[i]))
            row.update(template=key, judge_prompt=text)
            prompts.append([{"role": "user", "content": text}])
            prompt_rows.append(i)
        rows.append(row)

    if prompts:
        logger.info("judge: %d prompts to %s (%d rows scored by rule)", len(prompts), llm.name, int(rule.sum()))
        results = llm.generate(prompts, params)
        if len(results) != len(prompts):
            raise RuntimeError(f"judge LLM {llm.name} returned {len(results)} results for {len(prompts)} prompts")
        for i, res in zip(prompt_rows, results):
            text = SURROGATE_RE.sub("\ufffd", res.text or "")  # not UTF-8: the rows go to Parquet
            if res.error is not None:
                rows[i].update(error=SURROGATE_RE.sub("\ufffd", str(res.error)), judge_output=text)
                continue
            out = text.strip()
            rows[i].update(judge_output=out, label=parse_yes_no(out))
        n_err = sum(r.error is not None for r in results)
        if n_err:
            logger.warning("judge: %d of %d generations failed", n_err, len(results))

    out_df = pd.DataFrame(
        rows, columns=["query_id", "question_type", "template", "judge_prompt", "judge_output", "label", "error", "method"]
    )
    # keep True/False/None distinct (a bool column would turn None into False)
    out_df["label"] = pd.Series([r["label"] for r in rows], dtype=object)
    out_df["error"] = pd.Series([r["error"] for r in rows], dtype=object)
    return out_df


def aggregate_judge(judged: pd.DataFrame, by: str = "question_type") -> pd.DataFrame:
    """Judge accuracy overall (first row ``"overall"``) and per ``by`` group.

    ``accuracy`` = yes / n (unparseable and errored count as not correct, as the reference's
    ``'yes' in response`` would); ``accuracy_parsed`` = yes / (yes + no); ``n_unparseable`` = no error but
    no yes/no word; ``n_error`` = generation errors; ``n_rule`` = scored by the adversarial rule.
    """
    import pandas as pd


    def summarise(g: pd.DataFrame) -> dict[str, Any]:
        labels = list(g["label"])
        errors = list(g["error"])
        n_yes = sum(lab is True for lab in labels)
        n_parsed = sum(lab is not None for lab in labels)
        n_error = sum(e is not None and not (isinstance(e, float) and np.isnan(e)) for e in errors)
        return {
            "n": len(g),
            "accuracy": n_yes / len(g) if len(g) else float("nan"),
            "accuracy_parsed": n_yes / n_parsed if n_parsed else float("nan"),
            "n_yes": n_yes,
            "n_unparseable": len(g) - n_parsed - n_error,
            "n_error": n_error,
            "n_rule": int((g["method"] == "rule").sum()) if "method" in g.columns else 0,
        }

    rows = {"overall": summarise(judged)}
    if by in judged.columns:
        for key, g in judged.groupby(by, sort=True):
            rows[str(key)] = summarise(g)
    out = pd.DataFrame.from_dict(rows, orient="index")
    out.index.name = by
    return out


__all__ = [
    "ABSTENTION_KEY",
    "DEFAULT_JUDGE_PARAMS",
    "JUDGE_PROMPT_DIGEST",
    "JUDGE_PROMPT_VERSION",
    "JUDGE_TEMPLATES",
    "aggregate_judge",
    "judge_prompt",
    "parse_yes_no",
    "run_judge",
    "template_key",
]
