"""LLM backends: the CPU default (SmolLM2 GGUF through transformers) for real, plus prompt fitting."""

from __future__ import annotations

import pytest

from memgas.pipeline.config import LLMConfig
from memgas.pipeline.models.base import LLM, SamplingParams
from memgas.pipeline.models.factory import make_llm
from memgas.pipeline.models.llms import TransformersLLM, truncate_messages_middle


def _q(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def smol() -> TransformersLLM:
    # A small context keeps the truncation test cheap; the weights are cached per process.
    llm = make_llm(LLMConfig(context_tokens=256, batch_size=4))
    assert isinstance(llm, TransformersLLM)
    return llm


@pytest.mark.slow
def test_greedy_is_deterministic(smol: TransformersLLM) -> None:
    assert isinstance(smol, LLM)
    p = [_q("What is the capital of France?")]
    a = smol.generate(p, SamplingParams(max_tokens=8))
    b = smol.generate(p, SamplingParams(max_tokens=8))
    assert a[0].ok and a[0].text and a[0].text == b[0].text
    assert a[0].prompt_tokens > 5 and 0 < a[0].completion_tokens <= 8
    assert a[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_batch_matches_one_by_one_and_errors_are_per_item(smol: TransformersLLM) -> None:
    prompts = [
        _q("Alice met Bob at the park. They talked about their dogs. " * 4 + "\nSummarize the dialogue."),
        _q("Name a color."),
        [],  # invalid: its own error, the others still run
        _q(""),  # empty content is a valid (if odd) chat
    ]
    params = SamplingParams(max_tokens=4)
    batch = smol.generate(prompts, params)
    assert len(batch) == 4
    assert batch[2].error and not batch[2].ok
    assert batch[3].ok
    for i in (0, 1):
        single = smol.generate([prompts[i]], params)[0]
        # Left padding changes float rounding slightly; greedy outputs agree at least on the first tokens.
        assert batch[i].text.split()[:2] == single.text.split()[:2]


@pytest.mark.slow
def test_too_long_prompt_is_truncated_and_reported(smol: TransformersLLM) -> None:
    long = _q("blah " * 800 + "\nWhat is this text about?")
    r = smol.generate([long], SamplingParams(max_tokens=4))[0]
    assert r.ok, r.error
    assert r.extra.get("truncated") is True and r.extra["dropped_tokens"] > 0
    assert r.prompt_tokens <= smol.context_tokens - 4


@pytest.mark.slow
def test_stop_strings_and_count_tokens(smol: TransformersLLM) -> None:
    full = smol.generate([_q("What is the capital of France?")], SamplingParams(max_tokens=12))[0].text
    words = full.split()
    assert len(words) >= 2, f"need two words to test stop strings, got {full!r}"
    stop = words[1]  # a word the model does write: stopping there must cut the text before it
    r = smol.generate([_q("What is the capital of France?")], SamplingParams(max_tokens=12, stop=(stop,)))[0]
    assert stop not in r.text and full.startswith(r.text.rstrip()) and len(r.text) < len(full)
    # an empty stop string stops nothing (transformers' stop_strings matched it at once: one token, "length")
    r = smol.generate([_q("What is the capital of France?")], SamplingParams(max_tokens=12, stop=("",)))[0]
    assert r.text == full
    assert smol.count_tokens("hello world") == 2
    assert smol.count_tokens("") == 0


def test_truncate_messages_middle_keeps_both_ends() -> None:
    enc = lambda s: s.split()  # noqa: E731 - one word = one token
    dec = lambda ws: " ".join(ws)  # noqa: E731
    plen = lambda ms: sum(len(m["content"].split()) for m in ms)  # noqa: E731
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": " ".join(f"w{i}" for i in range(100)) + " QUESTION"}]
    out, dropped = truncate_messages_middle(msgs, plen, enc, dec, budget=40)  # type: ignore[arg-type]
    assert plen(out) <= 40 and dropped > 0
    assert out[0]["content"] == "be brief"
    assert out[1]["content"].startswith("w0 ") and out[1]["content"].endswith("QUESTION")
    assert msgs[1]["content"].endswith("QUESTION") and len(msgs[1]["content"].split()) == 101  # input intact
    same, d0 = truncate_messages_middle(msgs, plen, enc, dec, budget=1000)  # type: ignore[arg-type]
    assert same == msgs and d0 == 0
    with pytest.raises(ValueError):
        truncate_messages_middle(msgs, lambda ms: 10_000, enc, dec, budget=5)  # type: ignore[arg-type]


def test_optional_backends_fail_clearly_when_missing() -> None:
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        with pytest.raises(ImportError, match="llama-cpp-python"):
            make_llm(LLMConfig(backend="llama-cpp"))
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match="vllm"):
            make_llm(LLMConfig(backend="vllm", model="Qwen/Qwen2.5-7B-Instruct"))
    with pytest.raises(ValueError, match="base_url"):
        make_llm(LLMConfig(backend="openai"))
