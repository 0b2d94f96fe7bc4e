"""JustMem fixtures: the bundled LoCoMo sample ingested by the real loader (once per test session), and a fake
LLM backend for malformed output (a real model cannot produce a given malformed JSON on demand)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from memgas.pipeline.bank import Bank
from memgas.pipeline.models.base import ChatPrompt, GenerationResult, SamplingParams

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "data" / "sample" / "locomo_sample.json"


@pytest.fixture(scope="session")
def locomo_bank(tmp_path_factory) -> Bank:
    from memgas.pipeline.ingest import ingest

    path = tmp_path_factory.mktemp("justmem") / "bank"
    ingest(SAMPLE, "locomo", path, progress=False)
    return Bank(path)


class FakeLLM:
    """Implements the LLM interface; ``reply(prompt, call_number)`` scripts each output (a str, or an
    Exception instance to return as a backend error). Records every prompt and params."""

    name = "fake-llm"
    context_tokens = 100_000

    def __init__(self, reply: Callable[[ChatPrompt, int], str | Exception]) -> None:
        self.reply = reply
        self.calls: list[tuple[ChatPrompt, SamplingParams]] = []

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def generate(self, prompts: list[ChatPrompt], params: SamplingParams) -> list[GenerationResult]:
        out = []
        for p in prompts:
            n = len(self.calls)
            self.calls.append((p, params))
            r = self.reply(p, n)
            if isinstance(r, Exception):
                out.append(GenerationResult(error=str(r)))
            else:
                out.append(GenerationResult(text=r, prompt_tokens=self.count_tokens(p[-1]["content"]),
                                            completion_tokens=len(r.split())))
        return out
