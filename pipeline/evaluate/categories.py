"""Question categories: LoCoMo's numeric categories and the "says it cannot answer" rule.

This module is the one place the LoCoMo category table lives. LoCoMo (Maharana et al., 2024,
"Evaluating Very Long-Term Conversational Memory of LLM Agents", data file ``locomo10.json``) labels
each QA item with an integer ``category``; the names below are the pinned mapping used throughout
memgas (data loaders, reports, judge).

Category 5 ("adversarial") questions ask about something that never happened in the conversation; the
correct behaviour is to decline. LoCoMo's own evaluation scores them with a substring check
(``'no information available' in pred or 'not mentioned' in pred``); :func:`says_not_answerable` is a
broader, still deterministic, phrase matcher so that a polite "I don't know" also counts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

#: LoCoMo ``category`` -> name. Pinned; read-only so no caller can mutate it.
LOCOMO_CATEGORIES: Mapping[int, str] = MappingProxyType(
    {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
)
ADVERSARIAL_CATEGORY: int = 5
ADVERSARIAL: str = LOCOMO_CATEGORIES[ADVERSARIAL_CATEGORY]

#: LongMemEval's question types (``question_type`` in the data files).
LONGMEMEVAL_TYPES: tuple[str, ...] = (
    "single-session-user",
    "single-session-assistant",
    "single-session-preference",
    "multi-session",
    "temporal-reasoning",
    "knowledge-update",
)


def locomo_category_name(category: int | str) -> str:
    """Name of a LoCoMo category given as an int, a numeric string ("5") or already a name.

    Raises ``KeyError`` for an unknown number or name, so a data error surfaces instead of being
    silently bucketed as "other".
    """
    if isinstance(category, str):
        s = category.strip()
        if s in LOCOMO_CATEGORIES.values():
            return s
        if not s.lstrip("-").isdigit():
            raise KeyError(f"unknown LoCoMo category {category!r}")
        category = int(s)
    return LOCOMO_CATEGORIES[int(category)]


def is_adversarial(category: int | str) -> bool:
    """True for LoCoMo category 5 (given as 5, "5" or "adversarial")."""
    try:
        return locomo_category_name(category) == ADVERSARIAL
    except (KeyError, ValueError, TypeError):
        return False


def is_longmemeval_abstention(query_id: str) -> bool:
    """LongMemEval marks abstention (unanswerable) questions by a ``_abs`` suffix on ``question_id``.

    The reference evaluator tests ``'_abs' in question_id``; every id in the released files that
    contains it ends with it, so the two are the same on the data.
    """
    return "_abs" in str(query_id)


# Phrases that mean "the information is not there". Matched on a normalised string (lower case,
# curly quotes straightened, whitespace collapsed) with word boundaries, so "unknown" matches but
# "unknowingly" does not. Kept as regex fragments so variants (was not / wasn't / isn't) share a line.
_NEG = r"(?:not|n't|never)"
_NOT_AVAILABLE_PATTERNS: tuple[str, ...] = (
    # LoCoMo's own two phrases first.
    r"no information available",
    _NEG + r"\s+(?:been\s+|be\s+)?mentioned",
    r"no (?:information|info|mention|record|details?|data|evidence|indication|context|answer)\b",
    r"(?:not|n't) (?:available|specified|stated|provided|included|discussed|recorded|given|clear)",
    r"\bunavailable\b",
    r"(?:cannot|can't|can not|could not|couldn't) be (?:answered|determined|found|inferred|known)",
    r"(?:cannot|can't|can not|could not|couldn't|unable to) (?:answer|determine|find|tell|say|know|infer)",
    r"\bunanswerable\b",
    r"\bunknown\b",
    r"\bnot known\b",
    r"(?:don't|do not|doesn't|does not|didn't|did not) (?:know|say|mention|specify|state|indicate)",
    r"\bnot (?:in|part of) (?:the|my|our|this|these|any) (?:conversations?|context|memory|memories|records?|sessions?|dialogues?|chat)",
    r"\bnot possible to (?:answer|determine|know|tell|say)",
    r"\binsufficient information\b",
    r"\bnot enough information\b",
    r"\bn/a\b",
)
_NOT_AVAILABLE_RE = re.compile("|".join(f"(?:{p})" for p in _NOT_AVAILABLE_PATTERNS))
_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "`": "'"})


def says_not_answerable(hypothesis: object) -> bool:
    """True when a model answer says the information is not available / the question cannot be answered.

    Matches, on a lower-cased, quote-straightened, whitespace-collapsed copy of ``str(hypothesis)``,
    phrases such as "not mentioned", "no information", "not available", "cannot be answered",
    "unknown", "don't know", "unanswerable", "not specified", "not in the conversation".
    Superset of LoCoMo's adversarial check (``'no information available'`` / ``'not mentioned'``).
    ``None`` and empty strings are not a refusal (the model said nothing).
    """
    if hypothesis is None:
        return False
    text = " ".join(str(hypothesis).translate(_QUOTES).lower().split())
    if not text:
        return False
    return _NOT_AVAILABLE_RE.search(text) is not None


def adversarial_correct(hypothesis: object) -> bool:
    """LoCoMo category-5 rule: the answer is correct iff it declines (see :func:`says_not_answerable`)."""
    return says_not_answerable(hypothesis)
