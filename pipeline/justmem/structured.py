"""Structured LLM calls for JustMem: JSON output against a schema, one repair retry, and a verdict per item.

Both the card extractor and the planner go through :func:`call_structured`: the schema is passed to the
backend as ``SamplingParams.json_schema`` (vLLM guided decoding, ``response_format`` json_schema over
OpenAI-compatible HTTP, llama.cpp's schema grammar; the transformers backend ignores it and says so), and
the output is validated here either way, since not every backend enforces it and a truncated output is
invalid whatever the backend. An invalid output gets exactly one repair call (the prompt, the bad reply and
the problem); an output still invalid after it comes back with ``error`` set and ``value`` None, and the
caller applies its LLM-free fallback and records it (never silently). A call that failed in the backend
(connection refused, 5xx, 429 or a timeout after the client's own retries), in the first call or in the
repair, is no answer at all: it comes back with ``failed`` set, and the caller stores nothing for it, so that
the next run calls the LLM again.

Parsing is bounded, because a reply is untrusted input of any size and shape (runaway whitespace is a known
failure of JSON-guided decoding, and ``llm.timeout_s`` does not cover parsing): a reply longer than
``MAX_REPLY_CHARS`` is invalid unread; the parse is linear in the reply (no backtracking regex; at most
``MAX_OBJECT_STARTS`` candidate objects, each one scan and one decode); a structure nested deeper than
``MAX_JSON_DEPTH`` is invalid before the (recursive) decoder sees it. Every failure is an
:class:`InvalidOutput`, i.e. the repair/fallback path above, never another exception.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from memgas.pipeline.accounting import TokenLedger
from memgas.pipeline.llm_calls import SURROGATE_RE, generate_batch
from memgas.pipeline.models.base import LLM, ChatPrompt, GenerationResult, SamplingParams
from memgas.pipeline.models.llms import PROMPT_TOO_LONG
from memgas.pipeline.prompts import justmem_repair_prompt

#: Prompts per ``llm.generate`` call (as generation's CHUNK: backend batching and progress).
CHUNK = 64

#: Longest reply parsed, in characters. Far above any real reply (a session's cards at ``MAX_CARDS_PER_SESSION``
#: cards of ``CARD_TEXT_LIMIT`` characters would be about this size; a normal one is a few KB): a longer reply
#: is runaway output, invalid without being read.
MAX_REPLY_CHARS = 1_000_000
#: Deepest nesting of objects and arrays parsed. The JustMem schemas need 3 levels (object, list, object); the
#: json decoder recurses once per level and raises RecursionError near 1,000.
MAX_JSON_DEPTH = 32
#: ``{`` positions tried as the start of the reply's object (text or a code fence around it is tolerated);
#: bounds the parse to this many linear passes however many braces the reply holds.
MAX_OBJECT_STARTS = 8

#: Characters per token a reply's budget assumes for its free strings (cards, plan items): conservative for
#: English prose with SmolLM2's tokenizer (about 4). With the JSON schema bounding every string (``maxLength``)
#: and list (``maxItems``) to this budget, a greedy reply ends within ``max_tokens`` unless its strings are
#: denser than this, so the schema-enforcing backends give valid output by construction.
BUDGET_CHARS_PER_TOKEN = 3
#: Tokens of whitespace a budget allows per object (a card, a plan, the wrapper): one per place the enforcer
#: lets the model put whitespace between JSON tokens (``MAX_JSON_WHITESPACES`` characters each).
BUDGET_WHITESPACE_TOKENS = 12

# a brace, a bracket, a whole JSON string (unrolled loop: no nested quantifier, so one pass), or a quote that
# opens a string never closed (matched last: the scan stops there instead of retrying from each later quote)
_TOKEN_RE = re.compile(r'[{}\[\]]|"[^"\\]*(?:\\.[^"\\]*)*"|"', re.DOTALL)
_DECODER = json.JSONDecoder()
_FENCE_OPEN_RE = re.compile(r"\A\s*```[a-zA-Z]*\s*")


def strip_code_fences(text: str) -> str:
    """``text`` without a leading ```` ```lang ```` fence and a trailing ```` ``` ````, stripped. Linear: the
    trailing fence is found by ``rstrip`` (a regex ``\\s*```\\s*$`` retries from every whitespace character
    of a long trailing run, quadratic)."""
    text = _FENCE_OPEN_RE.sub("", text, count=1).strip()
    return text[:-3].strip() if text.endswith("```") else text


class InvalidOutput(ValueError):
    """An LLM output that does not satisfy the schema; the message names the first problem (it is sent back
    to the model in the repair prompt, so it says what to fix)."""


def _object_end(text: str, start: int) -> int | None:
    """End of the balanced ``{...}`` at ``start`` (strings skipped whole), None when it never closes.
    Raises InvalidOutput when it nests deeper than ``MAX_JSON_DEPTH`` (checked before decoding: the decoder
    would recurse that deep)."""
    depth = 0
    for m in _TOKEN_RE.finditer(text, start):
        tok = m.group()
        if tok == '"':  # a string that never closes: nothing after it closes the object
            return None
        c = tok[0]
        if c == '"':
            continue
        if c in "{[":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise InvalidOutput(f"the reply nests deeper than {MAX_JSON_DEPTH} levels")
        else:
            depth -= 1
            if depth == 0:
                return m.end()
    return None


def _check_text(obj: dict[str, Any]) -> None:
    """InvalidOutput when a string of ``obj`` holds a lone surrogate (a JSON ``\\ud800`` escape): not text,
    and no UTF-8 table can store it. One linear pass over the re-encoded object."""
    m = SURROGATE_RE.search(json.dumps(obj, ensure_ascii=False))
    if m:
        raise InvalidOutput(f"the reply holds a lone surrogate (\\u{ord(m.group()):04x}), which is not text")


def parse_json_object(raw: str) -> dict[str, Any]:
    """The first JSON object in ``raw`` (code fences and text around it tolerated), within the bounds of the
    module docstring. Raises InvalidOutput."""
    raw = raw or ""
    if len(raw) > MAX_REPLY_CHARS:
        raise InvalidOutput(f"the reply is {len(raw)} characters; at most {MAX_REPLY_CHARS} are parsed")
    if not raw.strip():
        raise InvalidOutput("the reply is empty")
    start = raw.find("{")
    for _ in range(MAX_OBJECT_STARTS):
        if start < 0:
            break
        end = _object_end(raw, start)
        if end is not None:  # None: never closes, so no complete object starts here
            try:
                obj = _DECODER.raw_decode(raw[start:end])[0]  # a dict: the span starts with "{"
            except ValueError:  # JSONDecodeError, or a number past Python's int digit limit
                obj = None
            if obj is not None:
                _check_text(obj)
                return obj
        start = raw.find("{", start + 1)
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
    #: the backend failed (transport, server side, timeout): no output to judge; store nothing, retry next run
    failed: bool = False


def backend_failed(r: GenerationResult) -> bool:
    """A call that failed in the backend and may succeed when repeated: every error but a prompt that does not
    fit the model's context (it would fail the same way every run; the caller records its fallback)."""
    return r.error is not None and not r.extra.get(PROMPT_TOO_LONG)


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
    invalid outputs get one repair call (batched), backend failures none (the client already retried), and
    neither does a reply over ``MAX_REPLY_CHARS``: the repair prompt would send it back whole. ``raw`` keeps
    at most ``MAX_REPLY_CHARS`` characters of a reply (the plans table records it)."""
    out = [StructuredResult() for _ in prompts]
    repair: list[int] = []
    for i, r in enumerate(generate_batch(llm, prompts, params, ledger, stage, chunk=CHUNK)):
        res = out[i]
        res.raw = r.text[:MAX_REPLY_CHARS]
        res.prompt_tokens, res.completion_tokens = r.prompt_tokens, r.completion_tokens
        if r.error is not None:
            res.error = f"llm: {r.error}"
            res.failed = backend_failed(r)
            continue
        res.value, problem = _check(r.text, validate, i)
        if problem is not None and len(r.text) > MAX_REPLY_CHARS:
            res.error = f"invalid output, not repaired: {problem}"
        elif problem is not None:
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
            res.failed = backend_failed(r)
            continue
        res.raw = r.text
        res.value, problem = _check(r.text, validate, i)
        if problem is None:
            res.repaired = True
        else:
            res.error = f"invalid output after one repair: {problem} (first: {res.first_problem})"
    return out
