"""Structured LLM calls for JustMem: JSON output against a schema, one repair retry, and a verdict per item.

Both the card extractor and the planner go through :func:`call_structured`: the schema is passed to the
backend as ``SamplingParams.json_schema`` (vLLM guided decoding, ``response_format`` json_schema over
OpenAI-compatible HTTP, llama.cpp's schema grammar; the transformers backend ignores it and says so), and
the output is validated here either way, since not every backend enforces it and a truncated output is
invalid whatever the backend. An invalid output gets exactly one repair call (the prompt, the bad reply and
the problem); an output still invalid after it comes back with ``error`` set and ``value`` None, and the
caller applies its LLM-free fallback and records it (never silently).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from memgas.pipeline.accounting import TokenLedger
from memgas.pipeline.llm_calls import generate_batch
from memgas.pipeline.models.base import LLM, ChatPrompt, SamplingParams
from memgas.pipeline.prompts import justmem_repair_prompt

#: Prompts per ``llm.generate`` call (as generation's CHUNK: backend batching and progress).
CHUNK = 64

_FENCE_RE = re.compile(r"^\s*```[a-zA-Z]*\s*|\s*```\s*$")


class InvalidOutput(ValueError):
    """An LLM output that does not satisfy the schema; the message names the first problem (it is sent back
    to the model in the repair prompt, so it says what to fix)."""


def parse_json_object(raw: str) -> dict[str, Any]:
    """The first JSON object in ``raw`` (code fences and text around it tolerated). Raises InvalidOutput."""
    text = _FENCE_RE.sub("", raw or "").strip()
    dec = json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        try:
            obj, _ = dec.raw_decode(text[m.start():])
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    if not text:
        raise InvalidOutput("the reply is empty")
    raise InvalidOutput("the reply holds no complete JSON object")


@dataclass
class StructuredResult:
    """One item: the validated value (None when unusable), the last raw output, tokens of both calls."""

    value: Any = None
    raw: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: why the output is unusable after the repair retry (None when ``value`` is set)
    error: str | None = None
    #: the value came from the repair call
    repaired: bool = False
    #: the first call's problem, kept when the repair fixed it (for the record)
    first_problem: str | None = None


def _check(raw: str, validate: Callable[[dict[str, Any], int], Any], i: int) -> tuple[Any, str | None]:
    try:
        return validate(parse_json_object(raw), i), None
    except InvalidOutput as exc:
        return None, str(exc)


def call_structured(
    llm: LLM,
    prompts: Sequence[ChatPrompt],
    validate: Callable[[dict[str, Any], int], Any],
    params: SamplingParams,
    *,
    ledger: TokenLedger | None,
    stage: str,
) -> list[StructuredResult]:
    """One call per prompt, validated by ``validate(obj, item_index)`` (raises :class:`InvalidOutput`);
    invalid outputs get one repair call (batched), backend failures none (the client already retried)."""
    out = [StructuredResult() for _ in prompts]
    repair: list[int] = []
    for i, r in enumerate(generate_batch(llm, prompts, params, ledger, stage, chunk=CHUNK)):
        res = out[i]
        res.raw, res.prompt_tokens, res.completion_tokens = r.text, r.prompt_tokens, r.completion_tokens
        if r.error is not None:
            res.error = f"llm: {r.error}"
            continue
        res.value, problem = _check(r.text, validate, i)
        if problem is not None:
            res.first_problem = problem
            repair.append(i)
    if not repair:
        return out
    if ledger is not None:
        ledger.count(stage, "repair", len(repair))
    fixes = [justmem_repair_prompt(list(prompts[i]), out[i].raw, out[i].first_problem or "") for i in repair]
    for i, r in zip(repair, generate_batch(llm, fixes, params, ledger, f"{stage}-repair", chunk=CHUNK)):
        res = out[i]
        res.prompt_tokens += r.prompt_tokens
        res.completion_tokens += r.completion_tokens
        if r.error is not None:
            res.error = f"invalid output ({res.first_problem}); repair call failed: {r.error}"
            continue
        res.raw = r.text
        res.value, problem = _check(r.text, validate, i)
        if problem is None:
            res.repaired = True
        else:
            res.error = f"invalid output after one repair: {problem} (first: {res.first_problem})"
    return out
