"""The LLM card extractor's reply: its JSON schema, the budget that bounds it, and the checks its cards pass.

A session's reply is bounded by its own schema (:func:`session_cards_schema`: the session's turn numbers, a
card count and string lengths that fit ``justmem.extract_max_tokens``, :func:`card_budget`), and checked after
parsing (:func:`grounded_cards`): provenance pointing at the turns shown, a type of ``CARD_TYPES``, and text
that states what its cited turns hold, once and whole (:func:`card_problem`):

* grounded: at least ``MIN_GROUNDED_SHARE`` of the card's content words occur in the cited turns
  (:func:`grounding`), and so do as many of each clause's (its sentences, cut at ";", line breaks, brackets,
  spaced dashes and at a comma before "and", "but", "also", ...): a faithful card plus " Also the password
  is hunter2." fails on its added sentence (0 of 2), though the whole card passes (the turn's words are most
  of it). Known limit: words slipped into a clause that is otherwise the turn's still pass;
* not repeated: no sentence twice (a small model that loops writes one sentence until the length limit);
* not cut off: a text as long as its schema's ``maxLength`` that does not end a sentence was closed there by
  the schema enforcer, mid-sentence.

A card failing one of these is dropped and named; the rest of the reply is kept.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memgas.pipeline.justmem.structured import (
    BUDGET_CHARS_PER_TOKEN,
    BUDGET_WHITESPACE_TOKENS,
    InvalidOutput,
)
from memgas.pipeline.justmem.text import CARD_TEXT_LIMIT, Card, Turn, _speaker, split_sentences, stop_words
from memgas.pipeline.models.base import LLM
from memgas.pipeline.schema import CARD_TYPES

#: Most cards one LLM reply may give a session (schema ``maxItems`` and validation); more is runaway output.
#: The LLM-free extractor's most on the bundled samples is 142 (a long LongMemEval session).
MAX_CARDS_PER_SESSION = 256
#: Longest text of an LLM card in a session's schema (``maxLength``), in characters: one statement (most
#: LLM-free cards of the bundled LoCoMo sample are shorter).
LLM_CARD_TEXT_CHARS = 200
#: Most cards per turn shown in a session's schema (``maxItems``): the LLM-free extractor makes about one per
#: turn on the bundled sample, and a small model that may write more repeats its last card until the limit.
LLM_CARDS_PER_TURN = 2
#: Longest ``time`` of an LLM card in a session's schema, in characters ("two weeks before the trip").
LLM_CARD_TIME_CHARS = 32
#: Share of a session's own characters per token the budget assumes for its cards' strings.
BUDGET_DENSITY_MARGIN = 0.75
#: Share of an LLM card's content words (:func:`grounding`) that must occur in the turns it cites, else the
#: card is invalid. Every LLM-free card of the bundled samples scores 100% (its words are its turns' words),
#: so the check never rejects that method's output; 50% leaves the LLM room to paraphrase ("prefers" for
#: "prefer", "attended" for "went to") while a card about something else ("The user's bank password is
#: hunter2", 0 of 4) fails.
MIN_GROUNDED_SHARE = 0.5


#: words the card format itself adds ("<speaker> said:", "[... shared an image: ...]"), not evidence
_FRAME_WORDS = frozenset("said wrote asked answered shared image".split())
_TOKEN_RE = re.compile(r"[^\W_]+")


def _grounding_words(text: str) -> list[str]:
    """Lower-cased word tokens (letters and digits; "hunter2" is one) of two characters or more, less stop
    words and the card format's own words."""
    stop = stop_words()
    return [w for w in _TOKEN_RE.findall(text.lower())
            if (len(w) > 1 or w.isdigit()) and w not in stop and w not in _FRAME_WORDS]


def _source_words(turns: Sequence[Turn]) -> set[str]:
    """The words cards may take from ``turns``: their text, role and the speaker label cards use."""
    source: set[str] = set()
    for t in turns:
        source.update(_grounding_words(f"{t.role} {_speaker(t.role)} {t.content}"))
    return source


def grounding(text: str, turns: Sequence[Turn]) -> tuple[int, int]:
    """(content words of ``text`` that occur in ``turns``, content words of ``text``): how much of a card its
    cited turns support. A turn's words include its role and the speaker label the cards use ("The user"
    for a "human" turn). Exact words, no stemming: the threshold (``MIN_GROUNDED_SHARE``) leaves room for
    inflections. Known limit: scripts without spaces between words (Chinese, Japanese) make one token per
    run of text, so a paraphrase there rarely matches."""
    source = _source_words(turns)
    words = _grounding_words(text)
    return sum(w in source for w in words), len(words)


# a clause boundary inside a sentence: a semicolon, a line break, a bracket, a spaced dash, or a comma before a
# word that opens another statement
_CLAUSE_SEP_RE = re.compile(r"\s*[;\n()\[\]]\s*|\s[-–—]+\s|"
                            r",\s+(?=(?:and|but|also|plus|so|while|whereas|though|although|yet)\b)", re.IGNORECASE)
# the end of a sentence, closing quotes and brackets after it allowed
_SENTENCE_END_RE = re.compile(r"[.!?…][\"'”’)\]]*\s*$")


def clauses(text: str) -> list[str]:
    """The clauses of a card's text: its sentences, each cut at ";", a line break, a bracket, a spaced dash,
    and at a comma before a conjunction or "also" ("..., and the password is hunter2")."""
    return [c for sent in split_sentences(text) for c in _CLAUSE_SEP_RE.split(sent) if c.strip()]


def card_problem(where: str, text: str, span: tuple[int, int], turns: Sequence[Turn],
                 text_chars: int | None = None) -> tuple[str, str] | None:
    """(kind, message) of the first problem of a card's ``text`` against the turns it cites (module
    docstring), None when it has none; kind is "ungrounded", "repeated" or "cut-off". ``span``: the turn
    numbers it cites, ``turns``: the session's turns shown (those of ``span`` are its source); ``text_chars``: the
    ``maxLength`` its schema gave the text (None: no cut-off check). Raises InvalidOutput for a text without
    content words, which no card can be."""
    source = _source_words([t for t in turns if span[0] <= t.turn_index <= span[1]])
    cited = f"turns {span[0]}..{span[1]}"
    words = _grounding_words(text)
    hit, total = sum(w in source for w in words), len(words)
    if not total:  # "...", "N/A": nothing to retrieve by (and an index of such cards has no vocabulary)
        raise InvalidOutput(f"{where}.text holds no content words; a card states something from the dialogue")
    if hit < MIN_GROUNDED_SHARE * total:
        return "ungrounded", (f"{where}.text is not grounded in {cited}: {hit} of its {total} content words occur "
                              f"there (at least {MIN_GROUNDED_SHARE:.0%} must)")
    sentences = [" ".join(_TOKEN_RE.findall(x.lower())) for x in split_sentences(text)]
    first: dict[str, int] = {}
    for i, sent in enumerate(sentences):
        if sent in first and _grounding_words(sent):
            return "repeated", (f"{where}.text repeats a sentence (sentence {i + 1} of {len(sentences)} is "
                                f"sentence {first[sent] + 1} again); a card states a fact once")
        first.setdefault(sent, i)
    if text_chars is not None and len(text) >= text_chars and not _SENTENCE_END_RE.search(text):
        return "cut-off", (f"{where}.text ends mid-sentence at its {text_chars}-character limit; a card is a "
                           "whole statement")
    parts = clauses(text)
    for i, part in enumerate(parts):
        words = _grounding_words(part)
        hit = sum(w in source for w in words)
        if hit < MIN_GROUNDED_SHARE * len(words):
            return "ungrounded", (f"{where}.text is not grounded in {cited}: its clause {i + 1} of {len(parts)} has "
                                  f"{hit} of its {len(words)} content words there (at least "
                                  f"{MIN_GROUNDED_SHARE:.0%} must)")
    return None


def _card_object(turn_numbers: Sequence[int] | None, text_chars: int | None, time_chars: int | None,
                 ) -> dict[str, Any]:
    """One card of the extraction schema. The turn numbers come first (the enforcer keeps the schema's field
    order): a small model then picks the turn and writes what it says, rather than writing a statement and
    guessing where it came from (SmolLM2-135M's cards cited turns that did not hold their words)."""
    turn: dict[str, Any] = {"type": "integer", "minimum": 0}
    if turn_numbers is not None:
        turn = {"type": "integer", "enum": sorted(set(turn_numbers))}
    text: dict[str, Any] = {"type": "string"}
    time: dict[str, Any] = {"type": "string"}
    if text_chars is not None:
        text["maxLength"] = text_chars
    if time_chars is not None:
        time["maxLength"] = time_chars
    return {
        "type": "object",
        "properties": {
            "turn_start": turn,
            "turn_end": dict(turn),
            "text": text,
            "type": {"type": "string", "enum": list(CARD_TYPES)},
            "time": time,
        },
        "required": ["turn_start", "turn_end", "text", "type", "time"],
        "additionalProperties": False,
    }


def _wrap(card: dict[str, Any], max_items: int) -> dict[str, Any]:
    cards = {"type": "array", "items": card, "minItems": 1, "maxItems": max_items}
    return {"type": "object", "properties": {"cards": cards}, "required": ["cards"], "additionalProperties": False}


def cards_json_schema() -> dict[str, Any]:
    """The extraction call's schema without a session's bounds (OpenAI strict mode: every property required,
    no extras): what :func:`validate_cards` checks, and the shape :func:`session_cards_schema` narrows."""
    return _wrap(_card_object(None, None, None), MAX_CARDS_PER_SESSION)


@dataclass(frozen=True)
class CardBudget:
    """How a session's extraction reply is bounded so that it fits ``justmem.extract_max_tokens``."""

    max_cards: int
    text_chars: int
    time_chars: int
    #: characters per token assumed for the card strings
    chars_per_token: float


def card_budget(llm: LLM, turns: Sequence[Turn], max_tokens: int) -> CardBudget:
    """The most cards (at most ``LLM_CARDS_PER_TURN`` per turn shown), and the longest text and time per
    card, whose JSON fits ``max_tokens`` tokens of ``llm`` in the worst case the budget assumes.

    The skeleton of a card (keys, punctuation, the longest type, the largest turn number) is counted with the
    model's own tokenizer, plus ``BUDGET_WHITESPACE_TOKENS`` for the whitespace the enforcer lets the model put
    between JSON tokens; the strings are counted at ``chars_per_token``: ``BUDGET_CHARS_PER_TOKEN``, or less
    when the session's own text is denser (digits, scripts without spaces: a card copies its turns' words), at
    ``BUDGET_DENSITY_MARGIN`` of the session's characters per token. A reply is then cut at ``max_tokens`` only
    when its strings are denser than that, and is invalid then as before (repair, then fallback)."""
    text = "\n".join(t.content for t in turns)
    n_tok = llm.count_tokens(text) if text else 0
    density = len(text) / n_tok if n_tok else float(BUDGET_CHARS_PER_TOKEN)
    cpt = max(1.0, min(float(BUDGET_CHARS_PER_TOKEN), BUDGET_DENSITY_MARGIN * density))
    big = max((t.turn_index for t in turns), default=0)
    longest_type = max(CARD_TYPES, key=len)
    skeleton = json.dumps({"turn_start": big, "turn_end": big, "text": "", "type": longest_type, "time": ""})
    card_tokens = llm.count_tokens(skeleton + ", ") + BUDGET_WHITESPACE_TOKENS
    wrapper_tokens = llm.count_tokens('{"cards": []}') + BUDGET_WHITESPACE_TOKENS
    time_chars = LLM_CARD_TIME_CHARS
    per_card = card_tokens + math.ceil(LLM_CARD_TEXT_CHARS / cpt) + math.ceil(time_chars / cpt)
    room = max_tokens - wrapper_tokens
    if room >= per_card:
        most = min(MAX_CARDS_PER_SESSION, LLM_CARDS_PER_TURN * max(1, len(turns)))
        return CardBudget(min(most, room // per_card), LLM_CARD_TEXT_CHARS, time_chars, cpt)
    # not even one full card fits: one card, its strings shortened to what is left (at least one character)
    time_chars = max(1, min(time_chars, int((room - card_tokens) * cpt) // 4))
    text_chars = max(1, int((room - card_tokens - math.ceil(time_chars / cpt)) * cpt))
    return CardBudget(1, min(text_chars, LLM_CARD_TEXT_CHARS), time_chars, cpt)


def session_cards_schema(turns: Sequence[Turn], budget: CardBudget) -> dict[str, Any]:
    """The schema of one session's extraction call: at most ``budget.max_cards`` cards whose strings fit the
    budget, citing only the turn numbers the prompt showed (``enum``)."""
    return _wrap(_card_object([t.turn_index for t in turns], budget.text_chars, budget.time_chars),
                 budget.max_cards)


#: Version of the LLM extractor's reply schema, of its per-session budget (:func:`card_budget`,
#: :func:`session_cards_schema`) and of the checks its cards pass (:func:`card_problem`); bump it when their
#: code changes. v2: turn numbers first and from the session's own (``enum``), strings and card count bounded
#: to fit ``justmem.extract_max_tokens``. v3: each clause grounded, no repeated sentence, no cut-off text.
LLM_CARDS_SCHEMA_VERSION = "cards-schema-v3"


def schema_digest() -> str:
    """``LLM_CARDS_SCHEMA_VERSION`` and a digest of the schema and the budget constants (part of the LLM
    extractor's key)."""
    from memgas.pipeline.models.json_constrained import MAX_JSON_WHITESPACES

    parts = [cards_json_schema(), LLM_CARD_TEXT_CHARS, LLM_CARD_TIME_CHARS, LLM_CARDS_PER_TURN, BUDGET_CHARS_PER_TOKEN,
             BUDGET_DENSITY_MARGIN, BUDGET_WHITESPACE_TOKENS, MAX_JSON_WHITESPACES]
    return f"{LLM_CARDS_SCHEMA_VERSION}-" + hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(),
                                                      digest_size=6).hexdigest()


def validate_cards(obj: dict[str, Any], turns: Sequence[Turn], text_chars: int | None = None) -> list[Card]:
    """Cards of a parsed extraction output, or InvalidOutput naming the first problem. ``turns``: the turns
    the prompt showed (provenance must point at them, and a card must state what the turns it cites hold:
    :func:`card_problem`); ``text_chars``: the schema's ``maxLength`` of a card's text."""
    cards, dropped = grounded_cards(obj, turns, text_chars)
    if dropped:
        raise InvalidOutput(dropped[0][1])
    return cards


def grounded_cards(obj: dict[str, Any], turns: Sequence[Turn], text_chars: int | None = None,
                   ) -> tuple[list[Card], list[tuple[str, str]]]:
    """(the cards of a parsed extraction output that pass :func:`card_problem` against the turns they cite,
    (kind, message) of each card that does not). Any other problem is InvalidOutput, and so is a reply none
    of whose cards passes: the LLM extractor keeps a reply's good cards and records the others (a small
    model's reply often starts with faithful cards and then repeats one against later turns: SmolLM2-135M on
    the bundled sample)."""
    items = obj.get("cards")
    if not isinstance(items, list):
        raise InvalidOutput('"cards" must be a list of card objects')
    if not items:
        raise InvalidOutput('"cards" is empty: a session has at least one card')
    if len(items) > MAX_CARDS_PER_SESSION:
        raise InvalidOutput(f'"cards" holds {len(items)} cards; at most {MAX_CARDS_PER_SESSION} per dialogue')
    shown = {t.turn_index for t in turns}
    lo, hi = min(shown), max(shown)
    out: list[Card] = []
    dropped: list[tuple[str, str]] = []
    for k, c in enumerate(items):
        where = f"cards[{k}]"
        if not isinstance(c, dict):
            raise InvalidOutput(f"{where} must be an object")
        text = c.get("text")
        if not isinstance(text, str) or not text.strip():
            raise InvalidOutput(f'{where}.text must be a non-empty string')
        if len(text) > CARD_TEXT_LIMIT:
            raise InvalidOutput(f"{where}.text is {len(text)} characters; a card is one short statement")
        typ = c.get("type")
        typ = typ.strip().lower() if isinstance(typ, str) else typ
        if typ not in CARD_TYPES:
            raise InvalidOutput(f"{where}.type must be one of {', '.join(CARD_TYPES)} (got {c.get('type')!r})")
        time = c.get("time", "")
        if time is not None and not isinstance(time, str):
            raise InvalidOutput(f'{where}.time must be a string ("" for the dialogue\'s date)')
        span = []
        for f in ("turn_start", "turn_end"):
            v = c.get(f)
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidOutput(f"{where}.{f} must be an integer turn number")
            if v not in shown:
                raise InvalidOutput(f"{where}.{f}={v} is not a turn number of the dialogue ({lo}..{hi})")
            span.append(v)
        if span[0] > span[1]:
            raise InvalidOutput(f"{where}: turn_start={span[0]} is after turn_end={span[1]}")
        problem = card_problem(where, text, (span[0], span[1]), turns, text_chars)
        if problem is not None:
            dropped.append(problem)
            continue
        t = " ".join(time.split()).lower() if time else ""
        out.append(Card(" ".join(text.split()), typ, t or None, span[0], span[1]))
    if not out:
        raise InvalidOutput(dropped[0][1])
    return out, dropped
