"""JSON-schema constrained decoding on the CPU transformers backend with the real SmolLM2:
the JustMem plan and cards schemas, in process and through `memgas serve`'s ``response_format``.

Unconstrained, SmolLM2-135M answers these prompts with prose or broken JSON (the backend ignored the schema).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from memgas.pipeline.justmem.llm_cards import card_budget, session_cards_schema
from memgas.pipeline.justmem.plan import plan_json_schema, validate_plan
from memgas.pipeline.justmem.text import Turn
from memgas.pipeline.models.base import SamplingParams
from memgas.pipeline.models.openai_http import OpenAIHTTPLLM
from memgas.pipeline.models.server import serve_in_thread
from memgas.pipeline.prompts import justmem_extract_prompt, justmem_numbered_turns, justmem_plan_prompt

QUESTIONS = ["When did Caroline go to the LGBTQ support group?", "What books has Melanie read?"]
TURNS = [Turn(0, "Caroline", "I went to a LGBTQ support group yesterday and it was so powerful."),
         Turn(1, "Melanie", "That's great, Caroline! I painted a lake sunrise last year.")]


def _plan_prompts() -> list:
    return [justmem_plan_prompt(q, "8 May 2023", 2) for q in QUESTIONS]


def _valid(text: str, schema: dict) -> dict:
    obj = json.loads(text)
    jsonschema.validate(obj, schema)
    return obj


@pytest.fixture(scope="module")
def plans(smollm) -> list:
    """The plan prompts decoded once in-process under the plan schema (the plan and server tests read them)."""
    return smollm.generate(_plan_prompts(), SamplingParams(max_tokens=256, json_schema=plan_json_schema(2)))


@pytest.mark.slow
def test_smollm2_plans_are_schema_valid_by_construction(plans) -> None:
    schema = plan_json_schema(2)
    for r in plans:
        assert r.ok and r.finish_reason == "stop" and r.extra["json_schema"] == "enforced", (r.error, r.text)
        validate_plan(_valid(r.text, schema), 2)


@pytest.mark.slow
def test_smollm2_cards_are_schema_valid_by_construction(smollm) -> None:
    # the session's schema: its turn numbers, and at most the cards whose JSON fits the 256 output tokens
    schema = session_cards_schema(TURNS, card_budget(smollm, TURNS, 256))
    prompt = justmem_extract_prompt(justmem_numbered_turns([(t.turn_index, t.role, t.content) for t in TURNS]),
                                    "conversation")
    r = smollm.generate([prompt], SamplingParams(max_tokens=256, json_schema=schema))[0]
    assert r.ok and r.finish_reason == "stop", (r.error, r.text)
    # schema-valid; grounding and turn numbers are checks no JSON schema expresses (validate_cards, then repair)
    assert _valid(r.text, schema)["cards"]


@pytest.mark.slow
def test_constrained_batch_matches_one_by_one(smollm) -> None:
    """A row's allowed tokens depend only on that row: a batch of two gives what each gives alone."""
    schema = plan_json_schema(2)
    # 48 tokens: the rows' masks part ways within the first tokens if at all (passed at 256 too, 2026-12-02)
    params = SamplingParams(max_tokens=48, json_schema=schema)
    batch = smollm.generate(_plan_prompts(), params)
    alone = [smollm.generate([p], params)[0] for p in _plan_prompts()]
    assert [r.text for r in batch] == [r.text for r in alone]


@pytest.mark.slow
def test_memgas_serve_honours_response_format_json_schema(smollm, plans) -> None:
    """The OpenAI client sends ``response_format: {type: json_schema}``; the server passes it to the backend,
    whose reply is the in-process one's (a row's allowed tokens depend on that row alone)."""
    schema = plan_json_schema(2)
    srv, _ = serve_in_thread(smollm)
    try:
        client = OpenAIHTTPLLM(srv.url, smollm.name, max_retries=0, timeout_s=600)
        r = client.generate(_plan_prompts()[:1], SamplingParams(max_tokens=256, json_schema=schema))[0]
    finally:
        srv.shutdown()
        srv.server_close()
    assert r.ok and r.finish_reason == "stop", (r.error, r.text)
    validate_plan(_valid(r.text, schema), 2)
    assert r.text == plans[0].text
