"""JustMem access planning: per question a structured spec and the fixed profile rule (paper §3.2.1, eq. 1).

A plan holds target ``entities``, ``time_constraints``, the ``operation`` to apply to the evidence (one of
``PLAN_OPERATIONS``), two binary needs ``d`` (distributed evidence) and ``f`` (source fidelity), up to two
answer-free ``rewrites``, and the ``profile`` given by :func:`profile_for` (never by a model):
Replay if f; Compose if d (and not f); Lookup otherwise.

LLM-free planner (``LLM_FREE_PLANNER``), rules over the question's wording (lower-cased), first match wins
for the operation:

* ``sorting``: "first", "last", "earliest", "latest", "most recent", "in what order", "order of",
  "before or after" -> d = 1.
* ``comparison``: "compare", "difference between", "more ... than", "less ... than", "which ... or",
  "both", "same" -> d = 1.
* ``aggregation``: "how many", "how much" (totals), "list", "all", "total", "in total", "every",
  "which ... times", "what are", "what kinds/types of", "what ... has/have ... ever", and "what/which" followed
  by a plural noun ("What books has Melanie read?") -> d = 1.
* ``temporal_selection``: "when", "what date/day/month/year/time", "how long ago/since", "before", "after",
  "during", "since", and any explicit time constraint -> d = 0.
* ``lookup`` otherwise, d = 0.

f = 1 when the question asks for source-level detail: "exact", "exactly", "code", "snippet", "script",
"command", "recipe", "steps", "step-by-step", "instructions", "word for word", "verbatim", "remind me",
"what did you (the assistant) say/suggest/recommend/tell/mention/provide/give/list" (also "you said/told/
suggested/recommended/mentioned/provided/gave/listed").

Entities: capitalised words and runs of them that are not the question's wh-word or a sentence-initial
function word, quoted phrases, and numbers. Time constraints: the time expressions of the question (the
card extractor's patterns) and "before/after/since/during <...>" phrases. Rewrites (answer-free: built only
from the question's own words; v2): (1) the entity view, a statement in the card style
("<Entity> said: <content words>", "The user said: ..." for a question in the first person), which matches
how cards read; (2) the time view ("<constraints>: <subject> <content words>") when the question has a time
constraint, else the keyword view (entities and content words). They are built for every question, so the
fixed Compose profile has them; the adaptive profile uses them only when d = 1. Retrieval
(:mod:`.retrieve`) reads the entities, the time constraints (:func:`.times.time_interval`) and the operation too;
terms fed back from the top cards (RM3) are found there, as they need the cards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from memgas.pipeline.accounting import TokenLedger
from memgas.pipeline.config import JustMemConfig
from memgas.pipeline.justmem.text import content_words
from memgas.pipeline.justmem.times import _PAST_RE, find_time
from memgas.pipeline.justmem.structured import (
    BUDGET_CHARS_PER_TOKEN,
    BUDGET_WHITESPACE_TOKENS,
    InvalidOutput,
    call_structured,
)
from memgas.pipeline.models.base import LLM, SamplingParams
from memgas.pipeline.prompts import JUSTMEM_PLAN_PROMPT_DIGEST, justmem_plan_prompt
from memgas.pipeline.schema import PLAN_OPERATIONS, PLANS

log = logging.getLogger(__name__)

#: Key of the LLM-free planner; bump the version whenever its output can change.
LLM_FREE_PLANNER = "llm-free/justmem-plan-v2"
#: v2: rewrites are the entity view and the time view (or keyword view); v1 put the keyword view first
#: Most ``entities`` and most ``time_constraints`` an LLM plan may hold (schema ``maxItems`` and validation; a
#: question names a handful; more is runaway output, not a plan).
MAX_PLAN_ITEMS = 16
#: Most entities and most time constraints in the LLM planner's schema (a question names a handful), and the
#: longest of each and of a rewrite, in characters, before the budget (:func:`plan_budget`) shortens them.
PLAN_SCHEMA_ITEMS = 4
PLAN_ITEM_CHARS = 40
PLAN_REWRITE_CHARS = 200
#: Version of the LLM planner's reply schema and its budget; bump it when their code changes. v2: every list
#: and string bounded so that the reply fits ``justmem.plan_max_tokens`` (a reply cut there is invalid).
PLAN_SCHEMA_VERSION = "plan-schema-v2"


def profile_for(d: bool, f: bool) -> str:
    """The fixed access rule (paper eq. 1): Replay if f; Compose if d and not f; Lookup otherwise."""
    if f:
        return "replay"
    if d:
        return "compose"
    return "lookup"


@dataclass
class Plan:
    entities: list[str] = field(default_factory=list)
    time_constraints: list[str] = field(default_factory=list)
    operation: str = "lookup"
    d: bool = False
    f: bool = False
    rewrites: list[str] = field(default_factory=list)

    @property
    def profile(self) -> str:
        return profile_for(self.d, self.f)


def planner_key(cfg: JustMemConfig, llm_name: str | None = None) -> str:
    """What the ``planner`` column holds for ``cfg`` (the rewrite count is part of it: it changes outputs)."""
    if cfg.planner == "llm-free":
        return f"{LLM_FREE_PLANNER}|r{cfg.rewrites}"
    if not llm_name:
        raise ValueError("justmem.planner=llm needs the LLM's name for the plans key")
    return f"{llm_name}|{LLM_PLANNER_VERSION}|r{cfg.rewrites}|out{cfg.plan_max_tokens}|fb:{LLM_FREE_PLANNER}"


# --------------------------------------------------------------------------------------------------
# LLM-free planner
# --------------------------------------------------------------------------------------------------

# "last" as in "last week" is a time constraint, not an order: excluded by the lookahead
_SORTING = re.compile(r"\b(?:first|last(?!\s+(?:night|week|weekend|month|year|summer|winter|spring|fall|autumn|"
                      r"monday|tuesday|wednesday|thursday|friday|saturday|sunday)\b)|earliest|latest|"
                      r"most recent(?:ly)?|in what order|order of|order did|before or after|chronological)\b")
_COMPARISON = re.compile(r"\b(?:compare|compared|comparison|difference between|differ|more \w+ than|"
                         r"less \w+ than|\w+er than|both|same)\b|\bwhich\b.*\bor\b")
_AGGREGATION = re.compile(r"\b(?:how many|how much|list|all|total|in total|every|altogether|combined|"
                          r"what are|what kinds? of|what types? of|which \w+ times|ever)\b")
_TEMPORAL = re.compile(r"\b(?:when|what (?:date|day|month|year|time)|how long (?:ago|since)|how long has|"
                       r"how long did|before|after|during|since|until)\b")
_FIDELITY = re.compile(
    r"\b(?:exact|exactly|code|snippet|script|command|recipe|steps|step-by-step|step by step|instructions?|"
    r"word for word|verbatim|remind me|"
    r"what did you (?:say|suggest|recommend|tell|mention|provide|give|list|write)|"
    r"you (?:said|told|suggested|recommended|mentioned|provided|gave|listed|wrote))\b")
_WH = frozenset("what when where which who whom whose why how did do does is are was were has have had can could "
                "would should will the a an in on at for of to and or i my me".split())
_PLURAL_AFTER_WH = re.compile(r"\b(?:what|which)\s+(?:kinds? of\s+|types? of\s+|other\s+)?([a-z]+s)\b")
#: plural-looking words that are not plural nouns ("does", "has", "is", "this", ...)
_NOT_PLURAL = frozenset("does has is was this his hers its always less yes bus gas plus news series means kids' "
                        "sports status focus process business campus various previous serious famous glass".split())
#: present-perfect wh-questions accumulate over time ("Where has Melanie camped?")
_PERFECT = re.compile(r"^(?:what|where|which|who)\b[^?]*?\b(?:has|have)\s+\w+\s+(?:\w+ed|been|done|made|read|seen|"
                      r"taken|gone|visited|tried|eaten|written|given|bought)\b")
_CONSTRAINT_RE = re.compile(r"\b(?:before|after|since|during|until|between)\s+[^,?.;]+", re.IGNORECASE)
_QUOTED_RE = re.compile(r"[\"“]([^\"”]+)[\"”]")
_CAP_RUN_RE = re.compile(r"\b[A-Z][\w'’-]*(?:\s+[A-Z][\w'’-]*)*")
_NUMBER_RE = re.compile(r"\b\d+(?:[.,]\d+)?\b")


def question_entities(question: str) -> list[str]:
    """Capitalised runs (without a leading wh-/function word), quoted phrases and numbers, in order, unique."""
    out: list[str] = []
    for m in _QUOTED_RE.finditer(question):
        out.append(m.group(1).strip())
    for m in _CAP_RUN_RE.finditer(question):
        words = m.group(0).split()
        while words and words[0].lower().strip("'’") in _WH:
            words = words[1:]
        run = " ".join(words).removesuffix("'s").removesuffix("’s")
        if run and run.lower() not in _WH:
            out.append(run)
    out += _NUMBER_RE.findall(question)
    seen: set[str] = set()
    return [e for e in out if not (e.lower() in seen or seen.add(e.lower()))]


def question_constraints(question: str) -> list[str]:
    out = [m.group(0).strip() for m in _CONSTRAINT_RE.finditer(question)]
    t = find_time(question)
    if t and not any(t in c.lower() for c in out):
        out.append(t)
    past = _PAST_RE.search(question.lower())  # "in the past three months" (LongMemEval's windows)
    if past and not any(past.group(0) in c.lower() for c in out):
        out.append(past.group(0))
    return out


def _has_plural_target(q: str) -> bool:
    for m in _PLURAL_AFTER_WH.finditer(q):
        w = m.group(1)
        if w not in _NOT_PLURAL and not w.endswith(("ss", "us", "is", "'s")) and len(w) > 3:
            return True
    return False


_FIRST_PERSON = re.compile(r"\b(?:i|i'm|i’m|i've|i’ve|my|me|mine|myself)\b", re.IGNORECASE)


def rule_rewrites(question: str, entities: Sequence[str], constraints: Sequence[str], n: int) -> list[str]:
    """Up to ``n`` answer-free rewrites from the question's own words (module docstring): the entity view
    ("<subject> said: <content words>", the way cards read), then the time view ("<constraints>: <subject>
    <content words>") when the question has a time constraint, else the keyword view."""
    if n <= 0:
        return []
    ent_low = {w.lower() for e in entities for w in e.split()}
    words = [w for w in content_words(question) if w not in ent_low]
    words = list(dict.fromkeys(words))
    names = [e for e in entities if not e.isdigit()]
    # cards name the user "The user" (LongMemEval); a question in the first person asks about the user, and
    # its named entities are what the user talked about
    if _FIRST_PERSON.search(question):
        subject, about = "The user", names
    else:
        subject, about = (names[0], names[1:]) if names else ("Someone", [])
    body = " ".join([*about, *words])
    entity_view = f"{subject} said: {body}".strip()
    if constraints:  # the constraints lead; their words are not repeated after them
        said = {w.lower() for c in constraints for w in c.split()}
        rest = " ".join(w for w in body.split() if w.lower() not in said)
        second = f"{'; '.join(constraints)}: {subject} {rest}".strip()
    else:
        second = " ".join([*entities, *words]).strip()
    out = [r for r in (entity_view, second) if r and r.lower() != question.lower()]
    return list(dict.fromkeys(out))[:n]


def plan_llm_free(question: str, n_rewrites: int) -> Plan:
    """The LLM-free plan of one question (rules in the module docstring)."""
    q = " ".join(question.lower().split())
    if _SORTING.search(q):
        op, d = "sorting", True
    elif _COMPARISON.search(q):
        op, d = "comparison", True
    elif _AGGREGATION.search(q) or _has_plural_target(q) or _PERFECT.search(q):
        op, d = "aggregation", True
    elif _TEMPORAL.search(q) or find_time(q):
        op, d = "temporal_selection", False
    else:
        op, d = "lookup", False
    f = bool(_FIDELITY.search(q))
    ents, cons = question_entities(question), question_constraints(question)
    return Plan(ents, cons, op, d, f, rule_rewrites(question, ents, cons, n_rewrites))


# --------------------------------------------------------------------------------------------------
# LLM planner
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanBudget:
    """Bounds of the LLM planner's reply: most entities and time constraints, and the longest of each and of a
    rewrite, in characters."""

    items: int
    item_chars: int
    rewrite_chars: int
    rewrites: int


def plan_json_schema(n_rewrites: int, budget: PlanBudget | None = None) -> dict[str, Any]:
    """Output schema of the planner call (OpenAI strict mode: every property required, no extras); with a
    ``budget`` (:func:`plan_budget`), every list and string bounded to it."""
    def strings(most: int, chars: int | None) -> dict[str, Any]:
        item: dict[str, Any] = {"type": "string"}
        if chars is not None:
            item["maxLength"] = chars
        return {"type": "array", "items": item, "maxItems": most}

    b = budget
    return {
        "type": "object",
        "properties": {
            "entities": strings(b.items if b else MAX_PLAN_ITEMS, b.item_chars if b else None),
            "time_constraints": strings(b.items if b else MAX_PLAN_ITEMS, b.item_chars if b else None),
            "operation": {"type": "string", "enum": list(PLAN_OPERATIONS)},
            "d": {"type": "boolean"},
            "f": {"type": "boolean"},
            "rewrites": strings(b.rewrites if b else n_rewrites, b.rewrite_chars if b else None),
        },
        "required": ["entities", "time_constraints", "operation", "d", "f", "rewrites"],
        "additionalProperties": False,
    }


def plan_budget(llm: LLM, n_rewrites: int, max_tokens: int) -> PlanBudget:
    """The largest bounds (at most ``PLAN_SCHEMA_ITEMS`` items of ``PLAN_ITEM_CHARS``, ``n_rewrites``
    rewrites of ``PLAN_REWRITE_CHARS``) whose reply fits ``max_tokens`` tokens of ``llm``: the skeleton
    counted with the model's tokenizer plus ``BUDGET_WHITESPACE_TOKENS``, each string's quotes and comma
    counted, its characters at ``BUDGET_CHARS_PER_TOKEN``. Strings shrink first (to a quarter), then the
    lists."""
    skeleton = json.dumps({"entities": [], "time_constraints": [], "operation": max(PLAN_OPERATIONS, key=len),
                           "d": False, "f": False, "rewrites": []})
    fixed = llm.count_tokens(skeleton) + BUDGET_WHITESPACE_TOKENS
    per_string = llm.count_tokens('"", ') + 1  # quotes, comma, and a whitespace token

    def cost(items: int, rewrites: int, scale: float) -> tuple[int, PlanBudget]:
        b = PlanBudget(items, max(1, int(PLAN_ITEM_CHARS * scale)), max(1, int(PLAN_REWRITE_CHARS * scale)),
                       rewrites)
        tok = (fixed + (2 * items + rewrites) * per_string + 2 * items * math.ceil(b.item_chars / BUDGET_CHARS_PER_TOKEN)
               + rewrites * math.ceil(b.rewrite_chars / BUDGET_CHARS_PER_TOKEN))
        return tok, b

    items, rewrites = PLAN_SCHEMA_ITEMS, n_rewrites
    while True:
        for scale in (1.0, 0.75, 0.5, 0.25):
            tok, b = cost(items, rewrites, scale)
            if tok <= max_tokens:
                return b
        if rewrites > 0 and rewrites >= items:
            rewrites -= 1
        elif items > 0:
            items -= 1
        else:  # not even the skeleton fits: the bounds are empty lists (the reply may still be cut; invalid then)
            return cost(0, 0, 0.25)[1]


#: What keys the LLM planner's outputs beside the model and the config: the prompt and the reply schema with
#: its budget constants; the ``planner`` column (:func:`planner_key`) and the plan stage's fingerprint
#: (jobs/keys.py) both take it from here.
LLM_PLANNER_VERSION = (f"{JUSTMEM_PLAN_PROMPT_DIGEST}|{PLAN_SCHEMA_VERSION}-"
                       + hashlib.blake2b(json.dumps([plan_json_schema(0), PLAN_SCHEMA_ITEMS, PLAN_ITEM_CHARS,
                                                     PLAN_REWRITE_CHARS, BUDGET_CHARS_PER_TOKEN,
                                                     BUDGET_WHITESPACE_TOKENS]).encode(), digest_size=6).hexdigest())


def _strings(obj: dict[str, Any], name: str, cap: int | None = None) -> list[str]:
    v = obj.get(name, [])
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise InvalidOutput(f'"{name}" must be a list of strings')
    if cap is not None and len(v) > cap:
        raise InvalidOutput(f'"{name}" holds {len(v)} items; at most {cap}')
    return [" ".join(x.split()) for x in v if x.strip()]


def validate_plan(obj: dict[str, Any], n_rewrites: int) -> Plan:
    """A plan from a parsed planner output, or InvalidOutput naming the first problem: more than
    ``MAX_PLAN_ITEMS`` entities or time constraints is invalid (the schema's bound); extra rewrites beyond
    ``n_rewrites`` are dropped (the budget is ours, not the model's)."""
    ents, cons = _strings(obj, "entities", MAX_PLAN_ITEMS), _strings(obj, "time_constraints", MAX_PLAN_ITEMS)
    op = obj.get("operation")
    op = op.strip().lower().replace(" ", "_") if isinstance(op, str) else op
    if op not in PLAN_OPERATIONS:
        raise InvalidOutput(f'"operation" must be one of {", ".join(PLAN_OPERATIONS)} (got {obj.get("operation")!r})')
    flags = []
    for name in ("d", "f"):
        v = obj.get(name)
        if isinstance(v, bool):
            flags.append(v)
        elif isinstance(v, int) and v in (0, 1):  # 0/1 is what the paper writes; accept it
            flags.append(bool(v))
        else:
            raise InvalidOutput(f'"{name}" must be true or false')
    rewrites = _strings(obj, "rewrites")[:n_rewrites]
    return Plan(ents, cons, op, flags[0], flags[1], rewrites)


# --------------------------------------------------------------------------------------------------
# plans of many questions
# --------------------------------------------------------------------------------------------------


def _row(qid: str, key: str, p: Plan, *, raw: str | None = None, prompt_tokens: int | None = None,
         completion_tokens: int | None = None, fallback: str | None = None, error: str | None = None) -> dict[str, Any]:
    return {"query_id": qid, "planner": key, "entities": p.entities, "time_constraints": p.time_constraints,
            "operation": p.operation, "d": p.d, "f": p.f, "rewrites": p.rewrites, "profile": p.profile,
            "raw_output": raw, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "fallback": fallback, "error": error}


def plan_queries(
    queries: Sequence[tuple[str, str, str | None]],
    cfg: JustMemConfig,
    *,
    key: str,
    llm: LLM | None = None,
    ledger: TokenLedger | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> pa.Table:
    """``PLANS`` rows for ``queries`` = ``(query_id, question, question_date)`` under planner ``key``
    (:func:`planner_key`), in input order. With ``cfg.planner == "llm"`` an output still invalid after one
    repair gets the LLM-free plan, with ``fallback`` naming why (never silent); a question whose call failed
    in the backend (:attr:`StructuredResult.failed`) gets no row, so the next run plans it again (the plan
    stage counts it as a failure)."""
    if cfg.planner == "llm-free":
        rows = [_row(qid, key, plan_llm_free(q, cfg.rewrites)) for qid, q, _ in queries]
        return pa.Table.from_pylist(rows, schema=PLANS)
    if llm is None:
        raise ValueError("justmem.planner=llm needs an LLM")
    prompts = [justmem_plan_prompt(q, date, cfg.rewrites) for _, q, date in queries]
    params = SamplingParams(max_tokens=cfg.plan_max_tokens, temperature=temperature, seed=seed,
                            json_schema=plan_json_schema(cfg.rewrites, plan_budget(llm, cfg.rewrites,
                                                                                   cfg.plan_max_tokens)))
    results = call_structured(llm, prompts, lambda obj, i: validate_plan(obj, cfg.rewrites), params,
                              ledger=ledger, stage="justmem-plan")
    rows = []
    n_fallback = n_failed = 0
    for (qid, q, _), res in zip(queries, results):
        tokens = dict(raw=res.raw, prompt_tokens=res.prompt_tokens, completion_tokens=res.completion_tokens)
        if res.failed:
            n_failed += 1
            log.warning("justmem plan: query %s: %s; nothing stored, the next run retries it", qid, res.error)
        elif res.value is not None:
            rows.append(_row(qid, key, res.value, **tokens))
        else:
            n_fallback += 1
            log.warning("justmem plan: query %s: %s; LLM-free plan used", qid, res.error)
            rows.append(_row(qid, key, plan_llm_free(q, cfg.rewrites), fallback=f"{LLM_FREE_PLANNER} ({res.error})",
                             **tokens))
    if ledger is not None:
        ledger.count("justmem-plan", "fallback", n_fallback)
        if n_failed:
            ledger.count("justmem-plan", "failed", n_failed)
    return pa.Table.from_pylist(rows, schema=PLANS)


def plans_from_table(plans: pa.Table) -> dict[str, Plan]:
    """{query_id: Plan} from ``PLANS`` rows (of one planner key)."""
    out = {}
    for r in plans.to_pylist():
        out[r["query_id"]] = Plan(list(r["entities"] or []), list(r["time_constraints"] or []), r["operation"],
                                  bool(r["d"]), bool(r["f"]), list(r["rewrites"] or []))
    return out
