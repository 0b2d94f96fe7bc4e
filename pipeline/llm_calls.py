"""One way to call an LLM on a batch: failures recorded per item, never raised; tokens and time ledgered.

Used by generation (summaries/keywords) and reading (filter/answer) alike.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence

from memgas.pipeline import faults
from memgas.pipeline.accounting import TokenLedger
from memgas.pipeline.models.base import LLM, ChatPrompt, GenerationResult, SamplingParams

log = logging.getLogger(__name__)

#: UTF-16 surrogate code points: not text on their own (an HTTP backend's JSON can carry "\ud800"), and
#: Parquet, which stores every reply, holds only UTF-8
SURROGATE_RE = re.compile("[\ud800-\udfff]")


def generate_batch(
    llm: LLM, prompts: Sequence[ChatPrompt], params: SamplingParams, ledger: TokenLedger | None, stage: str,
    *, chunk: int | None = None,
) -> list[GenerationResult]:
    """``llm.generate`` over ``prompts`` in chunks of ``chunk`` (all at once when None).

    A backend that raises, or returns the wrong number of results, yields one ``GenerationResult`` per
    prompt with ``error`` starting ``"llm: "``: callers treat those as retryable backend failures. A lone
    surrogate in a reply's text or error becomes U+FFFD (``SURROGATE_RE``).
    """
    out: list[GenerationResult] = []
    size = chunk or max(1, len(prompts))
    for a in range(0, len(prompts), size):
        part = list(prompts[a : a + size])
        t0 = time.perf_counter()
        try:
            faults.hit(f"llm:{stage}")  # reliability tests: a backend failure at a named call site
            res = llm.generate(part, params)
        except Exception as exc:  # a backend that raises must not sink the whole stage: record per item
            log.error("%s: LLM batch of %d prompts failed: %s", stage, len(part), exc)
            res = [GenerationResult(error=f"llm: {type(exc).__name__}: {exc}") for _ in part]
        if len(res) != len(part):
            log.error("%s: LLM returned %d results for %d prompts", stage, len(res), len(part))
            res = [GenerationResult(error="llm: result count mismatch") for _ in part]
        for r in res:  # U+FFFD: what a UTF-8 decoder shows for bad bytes
            if r.text and SURROGATE_RE.search(r.text):
                r.text = SURROGATE_RE.sub("\ufffd", r.text)
            if r.error and SURROGATE_RE.search(r.error):
                r.error = SURROGATE_RE.sub("\ufffd", r.error)
        if ledger is not None:
            ledger.record(stage, res, time.perf_counter() - t0)
        out.extend(res)
        if chunk:
            log.info("%s: %d/%d prompts", stage, min(a + size, len(prompts)), len(prompts))
    return out
