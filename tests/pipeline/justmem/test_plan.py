"""JustMem planning: the fixed profile rule, the LLM-free rules, answer-free rewrites, and the LLM planner's
schema, repair and fallback (fake backend)."""

from __future__ import annotations

import json
import re
from datetime import date, datetime

import pytest

from memgas.pipeline.accounting import TokenLedger
from memgas.pipeline.config import JustMemConfig
from memgas.pipeline.justmem.plan import (
    LLM_FREE_PLANNER,
    LLM_PLANNER_VERSION,
    MAX_PLAN_ITEMS,
    PLAN_ITEM_CHARS,
    PLAN_REWRITE_CHARS,
    PLAN_SCHEMA_ITEMS,
    Plan,
    PlanBudget,
    plan_budget,
    plan_json_schema,
    plan_llm_free,
    plan_queries,
    planner_key,
    plans_from_table,
    profile_for,
    validate_plan,
)
from memgas.pipeline.justmem.structured import InvalidOutput
from memgas.pipeline.justmem.times import time_interval
from memgas.pipeline.schema import KEYS, PLANS, TABLES

from .conftest import FakeLLM


def test_profile_rule() -> None:
    # paper eq. 1: Replay if f; Compose if f = 0 and d = 1; Lookup otherwise
    assert {(d, f): profile_for(d, f) for d in (False, True) for f in (False, True)} == {
        (False, False): "lookup", (True, False): "compose", (False, True): "replay", (True, True): "replay"}
    assert Plan(d=True, f=True).profile == "replay" and Plan(d=True).profile == "compose" and Plan().profile == "lookup"


@pytest.mark.parametrize("question, operation, d, f", [
    ("When did Caroline go to the LGBTQ support group?", "temporal_selection", False, False),
    ("What did Melanie do last weekend?", "temporal_selection", False, False),
    ("What activities does Melanie partake in?", "aggregation", True, False),
    ("How many times did Melanie go to the beach in 2023?", "aggregation", True, False),
    ("What books has Melanie read?", "aggregation", True, False),
    ("Where has Melanie camped?", "aggregation", True, False),
    ("Which did Caroline visit first, Paris or Rome?", "sorting", True, False),
    ("Is Caroline older than Melanie?", "comparison", True, False),
    ("What is Caroline's identity?", "lookup", False, False),
    ("Can you remind me of the exact recipe you suggested for the bread?", "lookup", False, True),
    ("What did you recommend for my trip to Tokyo?", "lookup", False, True),
    ("How many of the steps you listed involve the oven?", "aggregation", True, True),
])
def test_llm_free_rules(question, operation, d, f) -> None:
    p = plan_llm_free(question, 2)
    assert (p.operation, p.d, p.f) == (operation, d, f)


def test_llm_free_entities_constraints_and_answer_free_rewrites() -> None:
    q = "How many times did Melanie go to the beach in 2023?"
    p = plan_llm_free(q, 2)
    assert p.entities == ["Melanie", "2023"] and p.time_constraints == ["in 2023"]
    assert p.rewrites == ["Melanie said: times beach", "in 2023: Melanie times beach"]
    assert plan_llm_free(q, 1).rewrites == p.rewrites[:1] and plan_llm_free(q, 0).rewrites == []
    # answer-free: every rewrite word is a word of the question (or the card-style "said")
    words = set(re.findall(r"\w+", q.lower())) | {"said"}
    # the rewrites differ from the question and from each other: an entity view and a time view
    assert all(set(re.findall(r"\w+", r.lower())) <= words for r in p.rewrites)


def test_plans_table_schema_and_keys() -> None:
    assert TABLES["plans"] is PLANS and KEYS["plans"] == ("query_id", "planner")
    cfg = JustMemConfig()
    t = plan_queries([("q1", "What books has Melanie read?", None), ("q2", "When did Caroline move?", "1 May 2023")],
                     cfg, key=planner_key(cfg))
    assert t.schema == PLANS and t.column("planner").to_pylist() == [f"{LLM_FREE_PLANNER}|r2"] * 2
    assert t.column("profile").to_pylist() == ["compose", "lookup"]
    back = plans_from_table(t)
    assert back["q1"] == plan_llm_free("What books has Melanie read?", 2)


# -- LLM planner (fake backend) ---------------------------------------------------------------------------

GOOD = {"entities": ["Melanie"], "time_constraints": [], "operation": "aggregation", "d": True, "f": False,
        "rewrites": ["books Melanie read", "novels Melanie mentioned", "a third one"]}


def _cfg() -> JustMemConfig:
    return JustMemConfig(planner="llm")


def test_llm_planner_valid_output_uses_the_schema_and_trims_rewrites() -> None:
    llm = FakeLLM(lambda p, n: json.dumps(GOOD))
    t = plan_queries([("q1", "What books has Melanie read?", "2 June 2023")], _cfg(), key="k", llm=llm)
    prompt, params = llm.calls[0]
    assert params.json_schema == plan_json_schema(2, plan_budget(llm, 2, _cfg().plan_max_tokens))
    assert params.max_tokens == _cfg().plan_max_tokens
    assert "Question: What books has Melanie read?" in prompt[0]["content"]
    row = t.to_pylist()[0]
    assert (row["operation"], row["d"], row["f"], row["profile"]) == ("aggregation", True, False, "compose")
    assert row["rewrites"] == ["books Melanie read", "novels Melanie mentioned"]  # justmem.rewrites = 2
    assert row["fallback"] is None and row["prompt_tokens"] == llm.count_tokens(prompt[0]["content"])


def test_llm_planner_repairs_once() -> None:
    bad = json.dumps({**GOOD, "operation": "summarise"})
    fixed = json.dumps({**GOOD, "d": 0, "f": 1})  # 0/1 is accepted for the flags
    llm = FakeLLM(lambda p, n: bad if n == 0 else fixed)
    ledger = TokenLedger()
    t = plan_queries([("q1", "What books has Melanie read?", None)], _cfg(), key="k", llm=llm, ledger=ledger)
    assert len(llm.calls) == 2
    assert '"operation" must be one of lookup, aggregation' in llm.calls[1][0][-1]["content"]
    row = t.to_pylist()[0]
    assert (row["d"], row["f"], row["profile"], row["fallback"]) == (False, True, "replay", None)
    assert ledger.stages["justmem-plan"].counters == {"repair": 1, "fallback": 0}


def test_llm_planner_backend_failure_stores_no_plan() -> None:
    """A failed call is no answer: no row, so the next run plans the question again."""
    llm = FakeLLM(lambda p, n: RuntimeError("HTTP 500: injected") if n == 1 else json.dumps(GOOD))
    ledger = TokenLedger()
    t = plan_queries([("q1", "What books has Melanie read?", None), ("q2", "Where did Caroline go?", None)],
                     _cfg(), key="k", llm=llm, ledger=ledger)
    assert len(llm.calls) == 2 and t.column("query_id").to_pylist() == ["q1"]
    assert ledger.stages["justmem-plan"].counters == {"fallback": 0, "failed": 1}


@pytest.mark.parametrize("reply", ["", "{\"entities\": \"Melanie\"}", json.dumps({**GOOD, "d": "yes"})])
def test_llm_planner_falls_back_to_the_rules_and_says_why(reply) -> None:
    llm = FakeLLM(lambda p, n: reply)
    q = "What books has Melanie read?"
    t = plan_queries([("q1", q, None)], _cfg(), key="k", llm=llm)
    assert len(llm.calls) == 2
    row = t.to_pylist()[0]
    rules = plan_llm_free(q, 2)
    assert (row["operation"], row["d"], row["f"], row["rewrites"]) == (rules.operation, rules.d, rules.f, rules.rewrites)
    assert row["fallback"].startswith(f"{LLM_FREE_PLANNER} (invalid output after one repair: ")


def test_plan_lists_are_capped_in_the_schema_and_in_validation() -> None:
    schema = plan_json_schema(2)["properties"]
    assert schema["entities"]["maxItems"] == schema["time_constraints"]["maxItems"] == MAX_PLAN_ITEMS
    assert schema["rewrites"]["maxItems"] == 2
    many = {**GOOD, "entities": [f"e{i}" for i in range(10_000)]}
    with pytest.raises(InvalidOutput) as e:
        validate_plan(many, 2)
    assert str(e.value) == f'"entities" holds 10000 items; at most {MAX_PLAN_ITEMS}'
    with pytest.raises(InvalidOutput) as e:
        validate_plan({**GOOD, "time_constraints": ["x"] * (MAX_PLAN_ITEMS + 1)}, 2)
    assert str(e.value) == f'"time_constraints" holds {MAX_PLAN_ITEMS + 1} items; at most {MAX_PLAN_ITEMS}'
    assert validate_plan({**GOOD, "entities": ["x"] * MAX_PLAN_ITEMS}, 2).entities == ["x"] * MAX_PLAN_ITEMS
    # through the planner: recorded as invalid, the rules' plan used
    llm = FakeLLM(lambda p, n: json.dumps(many))
    ledger = TokenLedger()
    row = plan_queries([("q1", "What books has Melanie read?", None)], _cfg(), key="k", llm=llm,
                       ledger=ledger).to_pylist()[0]
    assert row["fallback"].startswith(f'{LLM_FREE_PLANNER} (invalid output after one repair: "entities" holds 10000')
    assert row["entities"] == plan_llm_free("What books has Melanie read?", 2).entities
    assert ledger.stages["justmem-plan"].counters == {"repair": 1, "fallback": 1}


def test_a_reply_that_is_not_valid_unicode_is_recorded_not_a_crash() -> None:
    """A lone surrogate in the reply's text (an HTTP backend's JSON can carry one) or escaped in its JSON: the
    plans table is written (Parquet needs UTF-8) with the rules' plan and the reply kept readable."""
    lone = json.dumps({**GOOD, "entities": ["Mel\ud800"]})  # json.dumps escapes it: "Mel\\ud800"
    for reply in ("bad \ud800 reply", lone):
        t = plan_queries([("q1", "What books has Melanie read?", None)], _cfg(), key="k",
                         llm=FakeLLM(lambda p, n, reply=reply: reply))
        row = t.to_pylist()[0]
        assert row["fallback"].startswith(f"{LLM_FREE_PLANNER} (invalid output after one repair: ")
        assert row["entities"] == plan_llm_free("What books has Melanie read?", 2).entities
    assert row["raw_output"] == lone
    t = plan_queries([("q1", "Q?", None)], _cfg(), key="k", llm=FakeLLM(lambda p, n: "bad \ud800 reply"))
    assert t.column("raw_output").to_pylist() == ["bad \ufffd reply"]


def test_a_reply_over_the_size_cap_is_not_sent_back_nor_stored_whole() -> None:
    """A runaway reply is not echoed into a repair prompt (60 MB would go back to the model) and the plans
    table keeps its first MAX_REPLY_CHARS characters only."""
    from memgas.pipeline.justmem.structured import MAX_REPLY_CHARS

    reply = json.dumps(GOOD) + " " * 2 * MAX_REPLY_CHARS
    llm = FakeLLM(lambda p, n: reply)
    ledger = TokenLedger()
    row = plan_queries([("q1", "What books has Melanie read?", None)], _cfg(), key="k", llm=llm,
                       ledger=ledger).to_pylist()[0]
    assert len(llm.calls) == 1
    assert row["fallback"] == (f"{LLM_FREE_PLANNER} (invalid output, not repaired: the reply is {len(reply)} "
                               f"characters; at most {MAX_REPLY_CHARS} are parsed)")
    assert row["raw_output"] == reply[:MAX_REPLY_CHARS]
    assert ledger.stages["justmem-plan"].counters == {"fallback": 1}


# -- rewrites and time constraints ----------------------------------------------------------------

@pytest.mark.parametrize("question, rewrites", [
    # entity view ("<subject> said: ...", as cards read), then the time view, or the keyword view
    ("When did Melanie go camping in June?", ["Melanie said: June camping", "june: Melanie camping"]),
    ("What books has Melanie read?", ["Melanie said: books read", "Melanie books read"]),
    # a first-person question is about the user (LongMemEval's cards say "The user said: ...")
    ("Where did I attend the Imagine Dragons concert?",
     ["The user said: Imagine Dragons attend concert", "Imagine Dragons attend concert"]),
    ("How many graduation ceremonies have I attended in the past three months?",
     ["The user said: graduation ceremonies attended past months",
      "past three months: The user graduation ceremonies attended"]),
])
def test_rewrites_differ_from_the_question(question, rewrites) -> None:
    p = plan_llm_free(question, 2)
    assert p.rewrites == rewrites
    assert all(r.lower() != question.lower() for r in p.rewrites) and len(set(p.rewrites)) == 2


def _days(a: date, b: date) -> tuple[int, int]:
    return a.toordinal(), b.toordinal()


NOW = datetime(2023, 3, 9, 15, 47)  # a Thursday


@pytest.mark.parametrize("text, days", [
    ("october 13, 2023", _days(date(2023, 10, 13), date(2023, 10, 13))),
    ("on 13 October 2023", _days(date(2023, 10, 13), date(2023, 10, 13))),
    ("july 2023", _days(date(2023, 7, 1), date(2023, 7, 31))),
    ("february, 2023", _days(date(2023, 2, 1), date(2023, 2, 28))),
    ("in 2022", _days(date(2022, 1, 1), date(2022, 12, 31))),
    ("june", _days(date(2022, 6, 1), date(2022, 6, 30))),  # its latest June up to now
    ("yesterday", _days(date(2023, 3, 8), date(2023, 3, 8))),
    ("last saturday", _days(date(2023, 3, 4), date(2023, 3, 4))),
    ("last thursday", _days(date(2023, 3, 2), date(2023, 3, 2))),  # strictly before today
    ("two weeks ago", _days(date(2023, 2, 20), date(2023, 2, 26))),
    ("4 years ago", _days(date(2019, 1, 1), date(2019, 12, 31))),
    ("last month", _days(date(2023, 2, 1), date(2023, 2, 28))),
    ("past three months", _days(date(2022, 12, 9), date(2023, 3, 9))),
    ("recently", _days(date(2023, 2, 6), date(2023, 3, 9))),
    ("before today", (1, date(2023, 3, 8).toordinal())),
    ("after july 2023", (date(2023, 8, 1).toordinal(), date.max.toordinal())),
    ("after the roadtrip", None),
    ("during the summer", None),
    ("may", None),  # mostly the verb
])
def test_time_interval(text, days) -> None:
    assert time_interval(text, NOW) == days


def test_relative_times_need_a_date() -> None:
    assert time_interval("yesterday", None) is None and time_interval("june", None) is None
    assert time_interval("july 2023", None) == _days(date(2023, 7, 1), date(2023, 7, 31))
    assert plan_llm_free("How many graduation ceremonies have I attended in the past three months?",
                         2).time_constraints == ["past three months"]


# -- the budgeted schema (a plan that fits plan_max_tokens, valid by construction) ------------


class _ThreeCharTokens(FakeLLM):
    """A tokenizer of 3 characters per token: the budget's assumption for the strings."""

    def __init__(self) -> None:
        super().__init__(lambda p, n: "")

    def count_tokens(self, text: str) -> int:
        return -(-len(text) // 3)


def _largest_plan(schema: dict) -> str:
    p = schema["properties"]

    def most(name: str) -> list[str]:
        return ["x" * p[name]["items"]["maxLength"]] * p[name]["maxItems"]

    return json.dumps({"entities": most("entities"), "time_constraints": most("time_constraints"),
                       "operation": max(p["operation"]["enum"], key=len), "d": False, "f": False,
                       "rewrites": most("rewrites")})


def test_the_largest_plan_the_budgeted_schema_allows_fits_the_output_budget() -> None:
    llm = _ThreeCharTokens()
    for max_tokens in (96, 128, 160, 256, 512, 1024):
        budget = plan_budget(llm, 2, max_tokens)
        assert llm.count_tokens(_largest_plan(plan_json_schema(2, budget))) <= max_tokens, (max_tokens, budget)
    assert plan_budget(llm, 2, 1024) == PlanBudget(PLAN_SCHEMA_ITEMS, PLAN_ITEM_CHARS, PLAN_REWRITE_CHARS, 2)
    small = plan_budget(llm, 2, 128)
    assert small.item_chars < PLAN_ITEM_CHARS and small.rewrite_chars < PLAN_REWRITE_CHARS
    # without a budget: the validator's bounds, strings unbounded (what other callers check a reply against)
    assert "maxLength" not in plan_json_schema(2)["properties"]["rewrites"]["items"]


def test_the_planner_key_names_the_prompt_and_the_schema() -> None:
    assert f"|{LLM_PLANNER_VERSION}|" in planner_key(_cfg(), "m") and "plan-schema-v2-" in LLM_PLANNER_VERSION
