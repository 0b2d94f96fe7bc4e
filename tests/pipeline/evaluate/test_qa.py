"""Lexical QA metrics and LoCoMo categories."""

from __future__ import annotations

import importlib.util
import math

import pandas as pd
import pytest

from memgas.pipeline.evaluate.categories import (
    LOCOMO_CATEGORIES,
    adversarial_correct,
    is_adversarial,
    locomo_category_name,
    says_not_answerable,
)
from memgas.pipeline.evaluate.qa import (
    aggregate_qa,
    bleu4,
    exact_match,
    normalize_answer,
    rouge_f,
    score_qa,
    token_f1,
)


def test_normalize_answer_squad() -> None:
    assert normalize_answer("The Cat, sat!  on a   mat.") == "cat sat on mat"
    assert normalize_answer("An apple") == "apple"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words
    assert normalize_answer(2019) == "2019"
    assert normalize_answer(None) == ""


def test_token_f1_hand() -> None:
    # pred tokens [cat, sat, on, mat], gold [cat, on, mat]: common 3, P = 3/4, R = 1, F1 = 2*.75/1.75
    assert token_f1("the cat sat on mat", "a cat on the mat") == pytest.approx(2 * 0.75 / 1.75)
    # multiset intersection: pred [a?] -> "cat cat" vs "cat": common 1, P = 1/2, R = 1 -> 2/3
    assert token_f1("cat cat", "cat") == pytest.approx(2 / 3)
    assert token_f1("dog", "cat") == 0.0
    assert token_f1("", "") == 1.0 and token_f1("", "cat") == 0.0 and token_f1("the", "cat") == 0.0


def test_non_string_answers() -> None:
    assert token_f1("2019", 2019) == 1.0
    assert exact_match("In 2019.", 2019) == 0.0
    assert exact_match("the 2019", 2019) == 1.0
    assert bleu4("7", 7) == pytest.approx(1.0)


def test_bleu_and_rouge() -> None:
    assert bleu4("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    assert bleu4("dog", "cat") == 0.0
    r = rouge_f("the cat sat", "the cat sat")
    assert r == pytest.approx({"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0})
    # hyp [the, cat], ref [the, cat, sat]: unigram P = 1, R = 2/3 -> F = 0.8 ; bigram P = 1, R = 1/2 -> 2/3
    r = rouge_f("the cat", "the cat sat", use_stemmer=False)
    assert r["rouge1"] == pytest.approx(0.8) and r["rouge2"] == pytest.approx(2 / 3)
    assert r["rougeL"] == pytest.approx(0.8)


def _qa_df() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "query_id": ["a", "b", "c_abs", "d"],
            "question_type": ["single-hop", "single-hop", "multi-session", "adversarial"],
            "hypothesis": ["Paris", "in 2019", "I don't know", "That was not mentioned."],
            "answer": ["Paris", 2020, "The user never said.", None],
        }
    )


def test_score_qa_per_query_and_aggregate() -> None:
    res = score_qa(_qa_df())
    pq = res.per_query
    assert pq["query_id"].tolist() == ["a", "b", "c_abs", "d"]
    assert pq.loc[0, "f1"] == 1.0 and pq.loc[0, "exact_match"] == 1.0
    # "in 2019" vs "2020": no common token
    assert pq.loc[1, "f1"] == 0.0
    assert pq["abstention"].tolist() == [False, False, True, True]
    assert pq.loc[2, "abstention_correct"] == 1.0 and pq.loc[3, "abstention_correct"] == 1.0
    assert math.isnan(pq.loc[0, "abstention_correct"])
    assert pq.loc[3, "answer"] == ""  # None -> "" not "None"
    by = res.by_type
    assert by.index.tolist() == ["overall", "adversarial", "multi-session", "single-hop"]
    assert by.loc["single-hop", "n"] == 2
    assert by.loc["single-hop", "f1"] == pytest.approx(0.5)
    assert by.loc["overall", "n_abstention"] == 2
    assert by.loc["adversarial", "abstention_correct"] == 1.0
    assert "bleu4_corpus" in by.columns
    pd.testing.assert_frame_equal(aggregate_qa(pq), by)


@pytest.mark.skipif(importlib.util.find_spec("bert_score") is not None, reason="bert_score installed here")
def test_bertscore_skipped_with_note() -> None:
    res = score_qa(_qa_df())
    assert "bertscore_f1" not in res.per_query.columns
    assert any("bertscore skipped" in n for n in res.notes)


def test_bertscore_disabled_note() -> None:
    res = score_qa(_qa_df(), bertscore=False)
    assert res.notes == ["bertscore skipped: disabled"]


def test_score_qa_missing_column() -> None:
    with pytest.raises(KeyError):
        score_qa(pd.DataFrame({"query_id": ["a"], "hypothesis": ["x"]}))


# ---- categories ------------------------------------------------------------------------------------------


def test_locomo_table_pinned() -> None:
    assert dict(LOCOMO_CATEGORIES) == {
        1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"
    }
    with pytest.raises(TypeError):
        LOCOMO_CATEGORIES[6] = "x"  # type: ignore[index]
    assert locomo_category_name(5) == "adversarial"
    assert locomo_category_name("2") == "temporal"
    assert locomo_category_name("single-hop") == "single-hop"
    with pytest.raises(KeyError):
        locomo_category_name(9)
    assert is_adversarial(5) and is_adversarial("5") and is_adversarial("adversarial")
    assert not is_adversarial(4) and not is_adversarial("multi-session")


@pytest.mark.parametrize(
    "text",
    [
        "Not mentioned.",
        "This information is not mentioned in the conversation.",
        "It wasn\u2019t mentioned.",
        "There is no information about her sister.",
        "No information available",
        "The information is not available.",
        "This question cannot be answered from the conversation.",
        "Unknown",
        "I don't know.",
        "I do not know which city.",
        "The conversation does not mention a dog.",
        "**Not specified**",
        "That is not in the conversation.",
        "Unanswerable",
        "I can't determine that.",
    ],
)
def test_says_not_answerable_positive(text: str) -> None:
    assert says_not_answerable(text)
    assert adversarial_correct(text)


@pytest.mark.parametrize(
    "text",
    ["Paris", "She went to the museum in 2019.", "Yes", "The answer is no", "unknowingly", "", None,
     "The recipe doesn't include nuts", "Nothing notable happened, she mentioned a dog"],
)
def test_says_not_answerable_negative(text: str | None) -> None:
    assert not says_not_answerable(text)
