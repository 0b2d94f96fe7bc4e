"""Token accounting per stage: how many requests and tokens each model stage spent.

The caller merges :meth:`TokenLedger.to_dict` into the bank manifest::

    bank.update_manifest(stages=ledger.to_dict())

Why a ledger and not just logs: the paper's cost comparison (and LLM bills) are about tokens per stage,
and a resumed run must be able to add to, not overwrite, what an earlier run spent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from memgas.pipeline.models.base import GenerationResult


@dataclass
class TokenStats:
    """What one model stage spent: requests, prompt/completion tokens, retries, failures, wall time."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    retries: int = 0
    failures: int = 0
    wall_s: float = 0.0
    #: free-form counters (e.g. ``input_truncated``, ``fallback``, ``context_cut``)
    counters: dict[str, int] = field(default_factory=dict)

    def merge(self, other: TokenStats) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.retries += other.retries
        self.failures += other.failures
        self.wall_s += other.wall_s
        for k, v in other.counters.items():
            self.counters[k] = self.counters.get(k, 0) + v


class TokenLedger:
    """Per-stage counters, updated from :class:`GenerationResult` lists."""

    def __init__(self) -> None:
        self.stages: dict[str, TokenStats] = {}

    def stage(self, name: str) -> TokenStats:
        return self.stages.setdefault(name, TokenStats())

    def record(self, stage: str, results: Iterable[GenerationResult], wall_s: float = 0.0) -> None:
        s = self.stage(stage)
        for r in results:
            s.requests += 1
            s.prompt_tokens += int(r.prompt_tokens or 0)
            s.completion_tokens += int(r.completion_tokens or 0)
            s.retries += int(r.retries or 0)
            if r.error is not None:
                s.failures += 1
        s.wall_s += wall_s

    def count(self, stage: str, counter: str, n: int = 1) -> None:
        c = self.stage(stage).counters
        c[counter] = c.get(counter, 0) + n

    def merge(self, other: TokenLedger) -> None:
        for name, s in other.stages.items():
            self.stage(name).merge(s)

    def to_dict(self) -> dict[str, dict]:
        out = {}
        for name, s in sorted(self.stages.items()):
            d = asdict(s)
            d["wall_s"] = round(d["wall_s"], 3)
            d["total_tokens"] = s.prompt_tokens + s.completion_tokens
            out[name] = d
        return out
