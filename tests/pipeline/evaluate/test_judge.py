"""LLM judge: prompt selection, yes/no parsing, batching and per-item errors, with a fake LLM."""

from __future__ import annotations

import pandas as pd
import pytest

from memgas.pipeline.evaluate.judge import (
    DEFAULT_JUDGE_PARAMS,
    JUDGE_TEMPLATES,
    aggregate_judge,
    judge_prompt,
    parse_yes_no,
    run_judge,
    template_key,
)
from memgas.pipeline.models.base import LLM, ChatPrompt, GenerationResult, SamplingParams


class FakeLLM:
    """Answers from a script keyed by a substring of the prompt; records every call."""

    name = "fake-judge"
    context_tokens = 4096

    def __init__(self, script: dict[str, GenerationResult | str], default: str = "yes") -> None:
        self.script = script
        self.default = default
        self.calls: list[tuple[list[ChatPrompt], SamplingParams]] = []

    def generate(self, prompts: list[ChatPrompt], params: SamplingParams) -> list[GenerationResult]:
        self.calls.append((prompts, params))
        out = []
        for p in prompts:
            content = p[-1]["content"]
            hit = next((v for k, v in self.script.items() if k in content), self.default)
            out.append(hit if isinstance(hit, GenerationResult) else GenerationResult(text=hit))
        return out

    def count_tokens(self, text: str) -> int:
        return len(text.split())


def test_fake_llm_satisfies_protocol() -> None:
    assert isinstance(FakeLLM({}), LLM)


@pytest.mark.parametrize(
    ("text", "label"),
    [
        ("yes", True), ("Yes.", True), ("**yes**", True), ("YES", True), ("The answer is yes", True),
        ("No", False), ("no.", False), ("**No**, the response is wrong", False), ("No, not yes", False),
        ("  \n Yes, it is correct", True), ("<think>no wait</think> yes", True), ("reasoning... </think>No", False),
        ("", None), ("nope", None), ("Not correct", None), ("Yesterday", None), ("The response is correct", None),
        (None, None),
    ],
)
def test_parse_yes_no(text: str | None, label: bool | None) -> None:
    assert parse_yes_no(text) is label


def test_reference_prompt_text_single_session_user() -> None:
    # Literal wording of LongMemEval evaluate_qa.py for single-session-user (note the space before "\n\n").
    expected = (
        "I will give you a question, a correct answer, and a response from a model. Please answer yes if the "
        "response contains the correct answer. Otherwise, answer no. If the response is equivalent to the correct "
        "answer or contains all the intermediate steps to get the correct answer, you should also answer yes. If "
        "the response only contains a subset of the information required by the answer, answer no. \n\n"
        "Question: Q?\n\nCorrect Answer: 42\n\nModel Response: It is 42.\n\n"
        "Is the model response correct? Answer yes or no only."
    )
    assert judge_prompt("single-session-user", "Q?", 42, "It is 42.") == expected


def test_per_type_prompt_selection() -> None:
    assert template_key("multi-session") == "multi-session"
    assert JUDGE_TEMPLATES["multi-session"] == JUDGE_TEMPLATES["single-session-assistant"]
    assert "off-by-one" in judge_prompt("temporal-reasoning", "q", "a", "r")
    assert "updated answer" in judge_prompt("knowledge-update", "q", "a", "r")
    pref = judge_prompt("single-session-preference", "q", "likes jazz", "r")
    assert "Rubric: likes jazz" in pref and "personal information" in pref
    ab = judge_prompt("multi-session", "q", "never said", "r", abstention=True)
    assert "unanswerable" in ab and "Explanation: never said" in ab
    # LoCoMo categories use the single-session-user template
    for cat in ("multi-hop", "temporal", "open-domain", "single-hop"):
        assert template_key(cat) == "single-session-user"
    # braces in values must not break formatting
    assert "{x}" in judge_prompt("single-session-user", "{x}", "{y}", "{z}")


def _judge_df() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "query_id": ["q1", "q2_abs", "q3", "q4", "q5", "q6"],
            "question_type": ["temporal-reasoning", "multi-session", "knowledge-update", "single-hop",
                              "adversarial", "single-session-user"],
            "question": ["Q1", "Q2", "Q3", "Q4", "Q5", "Q6"],
            "answer": ["18 days", "not said", "Boston", 2020, "", "blue"],
            "hypothesis": ["19 days", "I don't know", "Boston", "MARK-ERROR", "Not mentioned.", "MARK-GARBAGE"],
        }
    )


def test_run_judge_batches_and_labels() -> None:
    llm = FakeLLM(
        {
            "MARK-ERROR": GenerationResult(text="", error="timeout after 3 retries"),
            "MARK-GARBAGE": "I am not sure about this.",
            "Boston": "**No**",
        },
        default="Yes.",
    )
    out = run_judge(llm, _judge_df())
    assert len(llm.calls) == 1  # one batched call
    prompts, params = llm.calls[0]
    assert len(prompts) == 5  # adversarial row scored by rule
    assert params == DEFAULT_JUDGE_PARAMS
    assert all(p[0]["role"] == "user" for p in prompts)

    assert list(out.columns[:2]) == ["query_id", "question_type"]
    for col in ("judge_prompt", "judge_output", "label", "error"):
        assert col in out.columns
    by = out.set_index("query_id")
    assert by.loc["q1", "label"] is True and by.loc["q1", "template"] == "temporal-reasoning"
    assert by.loc["q2_abs", "template"] == "abstention"
    assert "correctly identify the question as unanswerable" in by.loc["q2_abs", "judge_prompt"]
    assert by.loc["q3", "label"] is False
    assert by.loc["q4", "label"] is None and by.loc["q4", "error"] == "timeout after 3 retries"
    assert by.loc["q5", "method"] == "rule" and by.loc["q5", "label"] is True and by.loc["q5", "judge_prompt"] == ""
    assert by.loc["q6", "label"] is None and by.loc["q6", "error"] is None
    assert by.loc["q1", "error"] is None

    agg = aggregate_judge(out)
    o = agg.loc["overall"]
    assert o["n"] == 6 and o["n_yes"] == 3 and o["n_error"] == 1 and o["n_unparseable"] == 1 and o["n_rule"] == 1
    assert o["accuracy"] == pytest.approx(3 / 6)
    assert o["accuracy_parsed"] == pytest.approx(3 / 4)
    assert agg.loc["knowledge-update", "accuracy"] == 0.0


def test_run_judge_adversarial_through_judge_and_is_abstention_column() -> None:
    df = _judge_df().iloc[[4, 5]].copy()
    df["is_abstention"] = [False, True]
    llm = FakeLLM({}, default="no")
    out = run_judge(llm, df, adversarial="judge", params=SamplingParams(max_tokens=5))
    assert len(llm.calls[0][0]) == 2
    assert out["template"].tolist() == ["abstention", "abstention"]
    assert out["label"].tolist() == [False, False]
    assert llm.calls[0][1].max_tokens == 5


def test_run_judge_no_llm_call_when_all_rule() -> None:
    llm = FakeLLM({})
    out = run_judge(llm, _judge_df().iloc[[4]])
    assert llm.calls == [] and out["label"].tolist() == [True]


def test_run_judge_length_mismatch_raises() -> None:
    class Broken(FakeLLM):
        def generate(self, prompts, params):  # type: ignore[override]
            return []

    with pytest.raises(RuntimeError):
        run_judge(Broken({}), _judge_df().iloc[[0]])


def test_a_judge_reply_that_is_not_valid_unicode_is_stored_readable() -> None:
    """A lone surrogate in a reply (an HTTP backend's JSON can carry one) or its error: the judged rows still
    go to Parquet (UTF-8 only), with U+FFFD in its place."""
    import pyarrow as pa

    llm = FakeLLM({"MARK-ERROR": GenerationResult(text="", error="HTTP 500: \udc80"), "Boston": "Yes \ud800"})
    out = run_judge(llm, _judge_df())
    by = out.set_index("query_id")
    assert (by.loc["q3", "judge_output"], by.loc["q3", "label"]) == ("Yes \ufffd", True)
    assert by.loc["q4", "error"] == "HTTP 500: \ufffd"
    pa.Table.from_pandas(out)  # raised UnicodeEncodeError


def test_parse_yes_no_is_linear_on_unclosed_think_tags() -> None:
    """1 MB of ``<think>`` never closed (a backend that ignores max_tokens): the old ``<think>.*?</think>``
    pass rescanned to the end from each tag (quadratic, ~20 min). In a subprocess with a hang bound, not a
    timing assert."""
    import subprocess
    import sys

    code = "from memgas.pipeline.evaluate.judge import parse_yes_no\nprint(parse_yes_no('<think>' * 150_000 + ' yes'))"
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("parse_yes_no on 1 MB did not end within 20 s: not linear")
    assert (r.returncode, r.stdout) == (0, "True\n"), r.stderr[-2000:]
