"""The two small interfaces every model backend implements: an encoder and an LLM.

Everything in memgas that calls a model goes through these, so a stage never knows which backend
(vLLM, an OpenAI-compatible HTTP server, a CPU model shipped in a wheel) is behind it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

#: A chat prompt: a list of {"role": "system"|"user"|"assistant", "content": str}.
ChatPrompt = list[dict[str, str]]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters shared by every LLM backend. Temperature 0 = greedy, deterministic."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int = 0
    #: JSON schema for structured output, where the backend supports it (vLLM guided decoding).
    json_schema: dict | None = None


@dataclass
class GenerationResult:
    """One item of a batch. ``error`` is set instead of raising, so one bad item never sinks a batch."""

    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    error: str | None = None
    retries: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None


@runtime_checkable
class LLM(Protocol):
    """A batch of chat prompts in, one :class:`GenerationResult` per prompt out (same order)."""

    name: str
    context_tokens: int

    def generate(self, prompts: list[ChatPrompt], params: SamplingParams) -> list[GenerationResult]: ...

    def count_tokens(self, text: str) -> int: ...


@runtime_checkable
class Encoder(Protocol):
    """Texts in, float32 [n, dim] out. ``normalize`` says whether rows come out unit-norm."""

    name: str
    dim: int
    max_tokens: int
    normalize: bool

    def encode(self, texts: list[str]) -> np.ndarray: ...
