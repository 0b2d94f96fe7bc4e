"""JustMem cards: atomic memory cards per unique session, LLM-free (the CPU default) or by one LLM call.

A card is one statement with its subject explicit, a type, a time relative to the session's date, and the
inclusive span of ``turn_index`` values it comes from (its provenance, what Replay recovers). Cards are keyed
by content: :func:`card_id` hashes (session_hash, extractor key, card_index), so a session shared by many
histories is extracted once, and a changed extractor (method version, model, prompt) writes new keys.

LLM-free method (``LLM_FREE_EXTRACTOR``, v3 "compact cards"; measured on LoCoMo and LongMemEval-S in
docs/benchmarks.md and ``benchmarks/justmem_quality.py``). A card should hold what a speaker states about
themselves and the world, once, in few words; per turn:

1. Code blocks (```` ``` ```` fences) and lists (two or more consecutive lines starting with ``-``, ``*``,
   ``•`` or ``1.``/``1)``, with the line introducing them when it ends in ``:``) are cut out whole, in the
   order they appear; each of a speaker's blocks becomes one ``interaction`` card: a compact card would lose
   exactly the details Replay exists for.
2. An **assistant** turn (role assistant/ai/bot) becomes at most one card of at most ``ASSISTANT_CARD_CHARS``
   characters: its first statement (the first sentence that is not a question and has two content words)
   and the heads of its list items ("1. **Kimchi**: spicy ..." -> "Kimchi"; else the words before the
   item's first ":" or " - ", else its first six words), joined by "; " and cut on a word boundary; its code
   blocks are kept whole (rule 1). A reply is the assistant's answer, not the user's memory: on
   LongMemEval-S it is 87% of the text and its lists are generic advice, while what the session is about is
   the user's request (kept, rule 3) and the names the reply gives (the heads).
3. Any other turn is split into sentences. A sentence is dropped when it has fewer than two content words
   (words of three letters or more that are neither stop words nor interjections: "Wow!", "Hey Mel! Good to
   see you!", "Thanks so much!"), or when it is a question between people (LoCoMo): questions ask for memory
   rather than state it, and mostly repeat the words of the answer that follows, which then competes with
   the answer for the same query. A **user**'s questions (role user/human: someone talking to an assistant)
   are kept: they are requests that say what the user needs ("Can you suggest trails near Denver?").
4. A sentence is dropped when its speaker already stated, in this session, a sentence holding all of its
   content words (a restatement adds nothing; the statement keeps the provenance of its first occurrence).
5. Consecutive kept sentences of a turn are merged into one card while each continues the previous one's
   subject: it opens with an anaphor or a connective ("I started pottery in May. They meet on Tuesdays.":
   alone, the second would not say what it is about), up to ``MERGE_CARD_CHARS``; other sentences are one
   card each. Merging sentences that merely share a word, or packing a turn, lowered NDCG@10 on LoCoMo.
   Each card is prefixed with the speaker: "Caroline said: ...", "The user said: ...". A card that would
   pass ``CARD_TEXT_LIMIT`` (the limit LLM cards are held to; an unpunctuated turn is one "sentence") is cut
   on word boundaries into several cards of the same turn, each with the prefix; so is a code/list card,
   and an image note that does not fit on the turn's last card gets its own.
6. A non-assistant turn whose every sentence was dropped but which answers the previous turn's question
   ("Yes, I did!") becomes one card holding the question and the answer, spanning both turns.
7. A shared image (LoCoMo's BLIP caption) is appended to the turn's last card: "[Melanie shared an image:
   a photo of ...]", or is the turn's only card.
8. A session whose every turn was dropped keeps its longest turn as one card, so that every non-empty session
   has at least one card (which also marks it as extracted).

The card budget of a session thus follows its content: one card per subject a speaker states (restatements
dropped), one short card per assistant reply, one per code/list block. Every card's words are words of the
turns its span names (:func:`grounding` is 100% on both bundled samples): cards are cut and joined from the
turns' own text, never rewritten. On the LongMemEval-S sample: 16.9 cards per session instead of 56 (v2), a
quarter of v2's encoder input tokens (611,394 against 2,450,385).

Types (first rule that matches): ``interaction`` for code/list cards and assistant turns; ``preference`` for
likes/loves/enjoys/prefers/favourite/hates; ``event`` when the card holds a time expression or an event verb
(went, visited, attended, joined, started, ...); ``state`` for "I am/I'm/I have/I feel/currently/these days";
``fact`` otherwise. ``time`` is the card's first time expression ("yesterday", "last week", "two weeks ago",
"2022"), lower-cased; null means the session's date. :func:`resolve_time` turns it into a date or a phrase
against the session date of the history being read ("yesterday" on 8 May 2023 -> "7 May 2023").
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pyarrow as pa
from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

from memgas.pipeline.accounting import TokenLedger
from memgas.pipeline.config import JustMemConfig
from memgas.pipeline.data.locomo import CAPTION_SEP
from memgas.pipeline.hashing import text_hash
from memgas.pipeline.justmem.structured import (
    BUDGET_CHARS_PER_TOKEN,
    BUDGET_WHITESPACE_TOKENS,
    InvalidOutput,
    StructuredResult,
    call_structured,
)
from memgas.pipeline.models.base import LLM, SamplingParams
from memgas.pipeline.prompts import (
    JUSTMEM_EXTRACT_PROMPT_DIGEST,
    dialogue_kind_for,
    justmem_extract_prompt,
    justmem_numbered_turns,
)
from memgas.pipeline.schema import CARD_TYPES, CARDS

log = logging.getLogger(__name__)

#: Key of the LLM-free extractor; bump the version whenever its output can change.
#: v2: cards cut at ``CARD_TEXT_LIMIT`` (identical to v1's on both bundled samples, which have no card that long).
#: v3: compact cards: same-subject sentences merged, near-duplicates dropped, a user's requests to
#: an assistant kept, an assistant's reply cut to one short card.
LLM_FREE_EXTRACTOR = "llm-free/justmem-cards-v3"
#: Longest card the LLM-free extractor merges same-subject sentences of a turn into (a sentence longer than
#: this is still one card, cut at ``CARD_TEXT_LIMIT``).
MERGE_CARD_CHARS = 300
#: Longest card of an assistant's reply (its first statement and the heads of its list items), in characters.
ASSISTANT_CARD_CHARS = 240
#: Content words a sentence needs to be kept.
MIN_CONTENT_WORDS = 2
#: Longest card text, in characters, on both paths: an LLM card longer than this is invalid (a "card" that long
#: is a copy of the session, not a card); the LLM-free extractor cuts longer text on word boundaries into
#: several cards of the same turn span.
CARD_TEXT_LIMIT = 4000
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


@dataclass(frozen=True)
class Turn:
    """One utterance of a session, as in the ``turns`` table."""

    turn_index: int
    role: str
    content: str


@dataclass(frozen=True)
class Card:
    """A card before it gets its keys: statement, type, relative time, inclusive turn span."""

    text: str
    type: str
    time: str | None
    turn_start: int
    turn_end: int


# --------------------------------------------------------------------------------------------------
# keys
# --------------------------------------------------------------------------------------------------


def card_id(session_hash: str, extractor: str, card_index: int) -> str:
    """Content key of a card: 128-bit hash of (session_hash, extractor, card_index)."""
    h = hashlib.blake2b(digest_size=16)
    for part in (session_hash, extractor, str(card_index)):
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def extractor_key(cfg: JustMemConfig, llm_name: str | None = None) -> str:
    """What the ``extractor`` column holds for ``cfg``: the LLM-free key, or ``model|prompt digest`` (the
    fallback's key is part of it: a changed LLM-free method changes what fallback rows hold)."""
    if cfg.extractor == "llm-free":
        return LLM_FREE_EXTRACTOR
    if not llm_name:
        raise ValueError("justmem.extractor=llm needs the LLM's name for the cards key")
    return (f"{llm_name}|{LLM_EXTRACTOR_VERSION}|in{cfg.extract_max_input_tokens}"
            f"|out{cfg.extract_max_tokens}|fb:{LLM_FREE_EXTRACTOR}")


# --------------------------------------------------------------------------------------------------
# LLM-free extractor
# --------------------------------------------------------------------------------------------------

# sklearn's English stop words plus chat interjections: words that carry no memory on their own


_INTERJECTIONS = frozenset(
    "hey hi hello wow yeah yes yep nope thanks thank haha hahaha lol omg cool awesome great nice good glad "
    "totally really sure okay amazing congrats congratulations bye see soon hear sounds awesome wonderful "
    "fantastic sweet lovely true absolutely definitely agree welcome talk later chat care".split())
# auxiliaries sklearn's list lacks ("do" is there, "did"/"does" are not)
_AUX = frozenset("did does doing done has had having got gets getting gonna wanna let lets".split())
_STOP = frozenset(ENGLISH_STOP_WORDS) | _INTERJECTIONS | _AUX
_WORD_RE = re.compile(r"[A-Za-z][A-Za-z'’]+")
_FENCE_BLOCK_RE = re.compile(r"```.*?(?:```|\Z)", re.DOTALL)
_LIST_LINE_RE = re.compile(r"^\s*(?:[-*•·]|\d{1,3}[.)])\s+\S")
#: words after which a period does not end a sentence
_ABBREV = frozenset("mr mrs ms dr st vs etc e.g i.e jr sr prof no approx".split())
_SENT_BOUNDARY_RE = re.compile(r"([.!?]+)([\"')\]]*)\s+")

_MONTHS = ("january|february|march|april|may|june|july|august|september|october|november|december")
_WEEKDAYS = "monday|tuesday|wednesday|thursday|friday|saturday|sunday"
_NUM = r"(?:\d+|a|an|one|two|three|four|five|six|seven|eight|nine|ten|a few|few|couple of|a couple of)"
#: time expressions, most specific first (the first match is the card's ``time``)
_TIME_RE = re.compile(
    rf"\b(?:{_NUM}\s+(?:days?|weeks?|months?|years?)\s+ago"
    rf"|(?:last|next|this)\s+(?:night|week|weekend|month|year|summer|winter|spring|fall|autumn|{_WEEKDAYS})"
    rf"|yesterday|today|tonight|tomorrow|this\s+(?:morning|afternoon|evening)"
    rf"|(?:in|since|during|back\s+in)\s+(?:19|20)\d\d"
    rf"|(?:{_MONTHS})(?:\s+\d{{1,2}})?(?:,?\s+(?:19|20)\d\d)?"
    rf"|recently|the other day)\b",
    re.IGNORECASE)
_PREFERENCE_RE = re.compile(
    r"\b(?:love|loved|loves|like|likes|enjoy|enjoys|enjoyed|prefer|prefers|favou?rite|hate|hates|dislike|"
    r"passionate about|fan of|big fan|really into|obsessed with|can't stand)\b", re.IGNORECASE)
_EVENT_RE = re.compile(
    r"\b(?:went|go(?:ing)? to|visited|attended|joined|started|finished|bought|got|met|took|moved|signed up|"
    r"ran|made|painted|adopted|traveled|travelled|celebrated|won|lost|graduated|volunteered|hosted|planned|"
    r"gave|received|tried|learned|learnt|completed|launched|watched|read|saw|camped|hiked|created|built)\b",
    re.IGNORECASE)
_STATE_RE = re.compile(
    r"\b(?:i am|i'm|i’m|i have|i've|i’ve|i feel|i'm feeling|currently|these days|right now|still|"
    r"i live|i work|my \w+ (?:is|are))\b", re.IGNORECASE)


#: Longest speaker label a card starts with (a role is user data: a huge one must not fill the card limit).
_SPEAKER_CHARS = 100


def _speaker(role: str) -> str:
    low = role.strip().lower()
    if low in ("user", "human"):
        return "The user"
    if low in ("assistant", "ai", "bot", "system"):
        return "The assistant"
    return role.strip()[:_SPEAKER_CHARS].strip() or "Someone"


def _is_assistant(role: str) -> bool:
    return role.strip().lower() in ("assistant", "ai", "bot")


def content_words(text: str) -> list[str]:
    """Words of three letters or more that are neither stop words nor interjections ("Melanie's" -> melanie)."""
    words = (m.group(0).lower().replace("’", "'").removesuffix("'s") for m in _WORD_RE.finditer(text))
    return [w for w in words if len(w) >= 3 and w not in _STOP and w.split("'")[0] not in _STOP]


#: words the card format itself adds ("<speaker> said:", "[... shared an image: ...]"), not evidence
_FRAME_WORDS = frozenset("said wrote asked answered shared image".split())
_TOKEN_RE = re.compile(r"[^\W_]+")


def _grounding_words(text: str) -> list[str]:
    """Lower-cased word tokens (letters and digits; "hunter2" is one) of two characters or more, less stop
    words and the card format's own words."""
    return [w for w in _TOKEN_RE.findall(text.lower())
            if (len(w) > 1 or w.isdigit()) and w not in _STOP and w not in _FRAME_WORDS]


def grounding(text: str, turns: Sequence[Turn]) -> tuple[int, int]:
    """(content words of ``text`` that occur in ``turns``, content words of ``text``): how much of a card its
    cited turns support. A turn's words include its role and the speaker label the cards use ("The user"
    for a "human" turn). Exact words, no stemming: the threshold (``MIN_GROUNDED_SHARE``) leaves room for
    inflections. Known limit: scripts without spaces between words (Chinese, Japanese) make one token per
    run of text, so a paraphrase there rarely matches."""
    source: set[str] = set()
    for t in turns:
        source.update(_grounding_words(f"{t.role} {_speaker(t.role)} {t.content}"))
    words = _grounding_words(text)
    return sum(w in source for w in words), len(words)


def split_sentences(text: str) -> list[str]:
    """Sentences of a prose paragraph: ends at ``.``/``!``/``?`` before whitespace, except after an
    abbreviation ("Dr.") or a single letter ("J.")."""
    out: list[str] = []
    start = 0
    for m in _SENT_BOUNDARY_RE.finditer(text):
        word = text[:m.start()].rsplit(None, 1)[-1].lower().rstrip(".") if text[:m.start()].strip() else ""
        if m.group(1) == "." and (word in _ABBREV or len(word) == 1):
            continue
        piece = text[start:m.end()].strip()
        if piece:
            out.append(piece)
        start = m.end()
    tail = text[start:].strip()
    if tail:
        out.append(tail)
    return out


def split_blocks(content: str) -> tuple[list[str], list[str]]:
    """(prose paragraphs, code/list blocks kept whole, in the order they appear) of one turn's text."""
    fences: list[str] = []

    def hold(m: re.Match[str]) -> str:
        fences.append(m.group(0).strip())
        return f"\n\n\0{len(fences) - 1}\0\n\n"  # a placeholder line: the block keeps its place

    rest = _FENCE_BLOCK_RE.sub(hold, content)
    blocks: list[str] = []
    prose: list[str] = []
    lines = rest.split("\n")
    i = 0
    para: list[str] = []
    while i < len(lines):
        j = i
        while j < len(lines) and _LIST_LINE_RE.match(lines[j]):
            j += 1
        if j - i >= 2:  # a list of two or more items, with the line that introduces it
            head = [para.pop()] if para and para[-1].rstrip().endswith(":") else []
            blocks.append("\n".join(head + lines[i:j]).strip())
            i = j
            continue
        placeholder = _PLACEHOLDER_RE.fullmatch(lines[i])
        if placeholder and int(placeholder.group(1)) < len(fences):  # (a NUL in the text itself is text)
            blocks.append(fences[int(placeholder.group(1))])
        elif lines[i].strip():
            para.append(lines[i].strip())
        elif para:
            prose.append(" ".join(para))
            para = []
        i += 1
    if para:
        prose.append(" ".join(para))
    return [p for p in prose if p.strip()], blocks


_PLACEHOLDER_RE = re.compile(r"\0(\d+)\0")


def find_time(text: str) -> str | None:
    """The first time expression of ``text``, lower-cased with single spaces (None: none)."""
    m = _TIME_RE.search(text)
    return " ".join(m.group(0).lower().split()) if m else None


def card_type(text: str, *, block: bool = False, assistant: bool = False) -> str:
    """The documented type rules (module docstring), in their order."""
    if block or assistant:
        return "interaction"
    if _PREFERENCE_RE.search(text):
        return "preference"
    if find_time(text) or _EVENT_RE.search(text):
        return "event"
    if _STATE_RE.search(text):
        return "state"
    return "fact"


_SPACE_RUN_RE = re.compile(r"\s+")


def cut_words(text: str, limit: int) -> list[str]:
    """``text`` in pieces of at most ``limit`` characters, cut at the last whitespace that fits (inside a word
    only when one word is longer than ``limit``). The pieces are the text's own substrings in order, so
    joining them with the whitespace cut out gives ``text`` back. One pass: each window is scanned once."""
    limit = max(limit, 1)
    out: list[str] = []
    pos = 0
    while len(text) - pos > limit:
        last = None
        for last in _SPACE_RUN_RE.finditer(text, pos + 1, pos + limit + 1):
            pass
        cut, nxt = (last.start(), last.end()) if last is not None else (pos + limit, pos + limit)
        out.append(text[pos:cut])
        m = _SPACE_RUN_RE.match(text, nxt)
        pos = m.end() if m else nxt
    if pos < len(text):
        out.append(text[pos:])
    return out


def _cards_of(prefix: str, body: str, *, i0: int, i1: int, block: bool, assistant: bool) -> list[Card]:
    """``prefix + body`` as one card, or, past ``CARD_TEXT_LIMIT``, as several cards of the same turn span
    (``body`` cut on word boundaries, each piece with the prefix; type and time per piece)."""
    return [Card(text=f"{prefix}{piece}", type=card_type(piece, block=block, assistant=assistant),
                 time=find_time(piece), turn_start=i0, turn_end=i1)
            for piece in cut_words(body, CARD_TEXT_LIMIT - len(prefix))]


def _make(speaker: str, body: str, *, i0: int, i1: int, block: bool, assistant: bool,
          verb: str = "said") -> list[Card]:
    return _cards_of(f"{speaker} {verb}: ", body, i0=i0, i1=i1, block=block, assistant=assistant)


def _is_question(sentence: str) -> bool:
    return sentence.rstrip("\"')] ").endswith("?")


#: words that open a sentence continuing the previous one's subject ("I started pottery. *They* meet ...")
_CONTINUES = frozenset("it its it's this that these those they them their there he she his her him also so "
                       "which then and but plus".split())


def continues(sentence: str) -> bool:
    """Whether ``sentence`` continues the previous sentence's subject: it opens with an anaphor or a
    connective ("They meet every Tuesday.", "And it was fun."), so alone it would not say what it is about."""
    first = sentence.split(None, 1)[0].strip(",.;:!?\"'()").lower().replace("’", "'") if sentence.strip() else ""
    return first in _CONTINUES


def _merge(sentences: list[tuple[tuple[int, int], str]], max_chars: int) -> list[str]:
    """Kept sentences of a turn, ``((paragraph, position in it), sentence)``, joined while each directly
    follows the previous one in its paragraph and continues its subject (:func:`continues`), up to
    ``max_chars`` a card: a merged card is still a contiguous passage of its turn."""
    out: list[str] = []
    last = (-1, -2)
    for k, s in sentences:
        if out and k == (last[0], last[1] + 1) and len(out[-1]) + 1 + len(s) <= max_chars and continues(s):
            out[-1] = f"{out[-1]} {s}"
        else:
            out.append(s)
        last = k
    return out


_BOLD_HEAD_RE = re.compile(r"^\*\*(.+?)\*\*")
_HEAD_SEP_RE = re.compile(r":|\s[-–—]\s")
#: Words of a list item kept as its head when the item has no "Head:" / "Head - " / "**Head**" of its own.
_HEAD_WORDS = 6


def item_head(line: str) -> str:
    """The head of one list item: its bold lead ("1. **Kimchi**: spicy ..." -> "Kimchi"), else the words
    before its first ":" or " - ", else its first ``_HEAD_WORDS`` words; markdown emphasis removed."""
    item = _LIST_LINE_MARK_RE.sub("", line.strip(), count=1).strip()
    m = _BOLD_HEAD_RE.match(item)
    if m:
        head = m.group(1)
    else:
        sep = _HEAD_SEP_RE.search(item)
        head = item[:sep.start()] if sep and len(item[:sep.start()].split()) <= _HEAD_WORDS else \
            " ".join(item.split()[:_HEAD_WORDS])
    return " ".join(head.replace("**", "").replace("__", "").split()).strip(" :;,.-–—*")


_LIST_LINE_MARK_RE = re.compile(r"^(?:[-*•·]|\d{1,3}[.)])\s+")


def _assistant_body(text: str, prose: list[str], blocks: list[str], max_chars: int) -> str:
    """An assistant's reply ``text`` as one short text: its first statement and the heads of its list items,
    cut to ``max_chars`` on a word boundary. A reply holds answers to the user, not the user's memory; what
    it is about is the user's request (kept) and the names it gives (the heads)."""
    lines = [ln for b in blocks if not b.startswith("```") for ln in b.split("\n")]
    statements = [s for p in [*prose, *(ln for ln in lines if not _LIST_LINE_RE.match(ln))]
                  for s in split_sentences(p)
                  if not _is_question(s) and len(content_words(s)) >= MIN_CONTENT_WORDS]

    def where(sentence: str) -> int:  # a paragraph's lines were joined: find the sentence by its first words
        at = text.find(sentence[:40])
        return at if at >= 0 else len(text)

    first = min(statements, key=where, default="")  # min keeps the earlier of equal positions
    heads = [h for h in (item_head(ln) for ln in lines if _LIST_LINE_RE.match(ln)) if content_words(h)]
    body = " ".join(p for p in (first, "; ".join(heads)) if p)
    return cut_words(body, max_chars)[0] if body else ""


def extract_llm_free(turns: Sequence[Turn], *, merge_chars: int = MERGE_CARD_CHARS,
                     assistant_chars: int = ASSISTANT_CARD_CHARS) -> list[Card]:
    """Cards of one session by the documented rules (module docstring). Deterministic; at least one card when
    any turn has text. ``merge_chars``/``assistant_chars``: the alternatives measured against the defaults
    (benchmarks/justmem_quality.py); the extractor key names the defaults only."""
    cards: list[Card] = []
    prev_question: tuple[Turn, str] | None = None  # the previous turn's last question, for short replies
    seen: dict[str, dict[str, list[frozenset[str]]]] = {}  # statements kept so far (:func:`_said_before`)
    for t in turns:
        text, _, caption = t.content.partition(CAPTION_SEP)
        speaker, assistant = _speaker(t.role), _is_assistant(t.role)
        prose, blocks = split_blocks(text)
        by_para = [split_sentences(p) for p in prose]
        sentences = [s for ss in by_para for s in ss]
        if assistant:
            body = _assistant_body(text, prose, blocks, assistant_chars)
            own = _make(speaker, body, i0=t.turn_index, i1=t.turn_index, block=False, assistant=True) if body else []
            own += [c for b in blocks if b.startswith("```")
                    for c in _make(speaker, b, i0=t.turn_index, i1=t.turn_index, block=True, assistant=True,
                                   verb="wrote")]
        else:
            # a "user" talks to an assistant: their questions are requests that say what they need
            keep_q = t.role.strip().lower() in ("user", "human")
            numbered = [((i, j), s) for i, ss in enumerate(by_para) for j, s in enumerate(ss)]
            kept = [(k, s) for k, s in numbered if (keep_q or not _is_question(s))
                    and len(content_words(s)) >= MIN_CONTENT_WORDS and not _said_before(seen, speaker, s)]
            own = [c for body in _merge(kept, merge_chars)
                   for c in _make(speaker, body, i0=t.turn_index, i1=t.turn_index, block=False, assistant=False)]
            own += [c for b in blocks for c in _make(speaker, b, i0=t.turn_index, i1=t.turn_index, block=True,
                                                     assistant=False, verb="wrote")]
            if not own and prev_question is not None and sentences and not caption:
                q_turn, q = prev_question
                body = f"{_speaker(q_turn.role)} asked: {q} {speaker} answered: {' '.join(sentences)}"
                own = _cards_of("", body, i0=q_turn.turn_index, i1=t.turn_index, block=False, assistant=False)
        if caption.strip():
            note = f"[{speaker} shared an image: {caption.strip()}]"
            if own and len(own[-1].text) + 1 + len(note) <= CARD_TEXT_LIMIT:
                last = own[-1]
                own[-1] = Card(f"{last.text} {note}", last.type, last.time, last.turn_start, last.turn_end)
            else:  # no card to carry it, or it would pass the limit: the note's own card(s)
                own += [Card(piece, "event", find_time(text), t.turn_index, t.turn_index)
                        for piece in cut_words(note, CARD_TEXT_LIMIT)]
        cards += own
        questions = [s for s in sentences if _is_question(s)]
        prev_question = (t, questions[-1]) if questions else None
    if not cards:
        longest = max(turns, key=lambda u: (len(u.content.strip()), -u.turn_index), default=None)
        if longest is not None and longest.content.strip():
            body = " ".join(longest.content.split())
            cards = _make(_speaker(longest.role), body, i0=longest.turn_index, i1=longest.turn_index,
                          block=False, assistant=_is_assistant(longest.role))
    return cards


def _said_before(seen: dict[str, dict[str, list[frozenset[str]]]], speaker: str, sentence: str) -> bool:
    """Whether ``speaker`` already made a statement holding every content word of ``sentence`` in this
    session (then it adds nothing: dropped, and the statement keeps its first provenance); records it if not.
    ``seen``: speaker -> {word: content-word sets of the statements holding it}, so that a long session is
    compared only against the statements sharing a word with the sentence, not all of them."""
    words = frozenset(content_words(sentence))
    by_word = seen.setdefault(speaker, {})
    if words:
        rarest = min(words, key=lambda w: len(by_word.get(w, ())))
        if any(words <= e for e in by_word.get(rarest, ())):
            return True
    for w in words:
        by_word.setdefault(w, []).append(words)
    return False


# --------------------------------------------------------------------------------------------------
# times
# --------------------------------------------------------------------------------------------------

_WORDNUM = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
            "eight": 8, "nine": 9, "ten": 10, "a few": 3, "few": 3, "couple of": 2, "a couple of": 2}


def fmt_date(d: datetime) -> str:
    """``8 May 2023`` (LoCoMo's answers spell dates this way)."""
    return f"{d.day} {d:%B %Y}"


def resolve_time(time: str | None, session_date: datetime | None) -> str | None:
    """A card's relative ``time`` against its session's date, as the reader should see it: a date
    ("yesterday" -> "7 May 2023"), a phrase anchored to the date ("last week" -> "the week before 8 May
    2023"), a year ("last year" -> "2022"), or the expression itself when it cannot be resolved. None when the
    card has no time of its own (its date is the session's)."""
    if not time:
        return None
    if session_date is None:
        return time
    t, d = time.lower().strip(), session_date
    if t in ("yesterday", "last night"):
        return fmt_date(d - timedelta(days=1))
    if t in ("today", "tonight", "this morning", "this afternoon", "this evening"):
        return fmt_date(d)
    if t == "tomorrow":
        return fmt_date(d + timedelta(days=1))
    if t == "last year":
        return str(d.year - 1)
    if t == "next year":
        return str(d.year + 1)
    if t == "this year":
        return str(d.year)
    m = re.fullmatch(r"(last|next)\s+(\w+)", t)
    if m:
        return f"the {m.group(2)} {'before' if m.group(1) == 'last' else 'after'} {fmt_date(d)}"
    m = re.fullmatch(rf"({_NUM})\s+(day|week|month|year)s?\s+ago", t)
    if m:
        n = int(m.group(1)) if m.group(1).isdigit() else _WORDNUM.get(m.group(1), 0)
        unit = m.group(2)
        if unit == "day" and n:
            return fmt_date(d - timedelta(days=n))
        if unit == "year" and n:
            return str(d.year - n)
        return f"{time} (before {fmt_date(d)})"
    return f"{time} (said on {fmt_date(d)})"


# --------------------------------------------------------------------------------------------------
# LLM extractor
# --------------------------------------------------------------------------------------------------


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


#: Version of the LLM extractor's reply schema and of its per-session budget (:func:`card_budget`,
#: :func:`session_cards_schema`); bump it when their code changes. v2: turn numbers first and from the
#: session's own (``enum``), strings and card count bounded to fit ``justmem.extract_max_tokens``.
LLM_CARDS_SCHEMA_VERSION = "cards-schema-v2"


def _schema_digest() -> str:
    from memgas.pipeline.models.json_constrained import MAX_JSON_WHITESPACES

    parts = [cards_json_schema(), LLM_CARD_TEXT_CHARS, LLM_CARD_TIME_CHARS, LLM_CARDS_PER_TURN, BUDGET_CHARS_PER_TOKEN,
             BUDGET_DENSITY_MARGIN, BUDGET_WHITESPACE_TOKENS, MAX_JSON_WHITESPACES]
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=6).hexdigest()


#: What keys the LLM extractor's outputs beside the model and the config: the prompt (wording and version)
#: and the reply schema with its budget constants. The one place both the ``extractor`` column
#: (:func:`extractor_key`) and the cards stage's fingerprint (jobs/keys.py) take it from.
LLM_EXTRACTOR_VERSION = f"{JUSTMEM_EXTRACT_PROMPT_DIGEST}|{LLM_CARDS_SCHEMA_VERSION}-{_schema_digest()}"


def validate_cards(obj: dict[str, Any], turns: Sequence[Turn]) -> list[Card]:
    """Cards of a parsed extraction output, or InvalidOutput naming the first problem. ``turns``: the turns
    the prompt showed (provenance must point at them, and a card's words must occur in the turns it cites:
    ``MIN_GROUNDED_SHARE``)."""
    cards, ungrounded = grounded_cards(obj, turns)
    if ungrounded:
        raise InvalidOutput(ungrounded[0])
    return cards


def grounded_cards(obj: dict[str, Any], turns: Sequence[Turn]) -> tuple[list[Card], list[str]]:
    """(the cards of a parsed extraction output grounded in the turns they cite, the problem of each card that
    is not). Any other problem is InvalidOutput, and so is a reply none of whose cards is grounded: the LLM
    extractor keeps a reply's grounded cards and records the others (a small model's reply often starts with
    faithful cards and then repeats one against later turns: SmolLM2-135M on the bundled sample)."""
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
    ungrounded: list[str] = []
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
        hit, total = grounding(text, [t for t in turns if span[0] <= t.turn_index <= span[1]])
        if not total:  # "...", "N/A": nothing to retrieve by (and an index of such cards has no vocabulary)
            raise InvalidOutput(f"{where}.text holds no content words; a card states something from the dialogue")
        if hit < MIN_GROUNDED_SHARE * total:
            ungrounded.append(f"{where}.text is not grounded in turns {span[0]}..{span[1]}: {hit} of its {total} "
                              f"content words occur there (at least {MIN_GROUNDED_SHARE:.0%} must)")
            continue
        t = " ".join(time.split()).lower() if time else ""
        out.append(Card(" ".join(text.split()), typ, t or None, span[0], span[1]))
    if not out:
        raise InvalidOutput(ungrounded[0])
    return out, ungrounded


def _fit_turns(llm: LLM, turns: Sequence[Turn], max_tokens: int) -> tuple[list[Turn], bool]:
    """The longest head of ``turns`` whose numbered rendering fits ``max_tokens`` (at least one turn)."""
    rendered = [justmem_numbered_turns([(t.turn_index, t.role, t.content)]) for t in turns]
    total, keep = 0, 0
    for r in rendered:
        total += llm.count_tokens(r) + 1
        if total > max_tokens and keep:
            break
        keep += 1
    return list(turns[:keep]), keep < len(turns)


# --------------------------------------------------------------------------------------------------
# the cards of many sessions
# --------------------------------------------------------------------------------------------------


def card_rows(session_hash: str, extractor: str, cards: Sequence[Card], *, prompt_tokens: int | None = None,
              completion_tokens: int | None = None, input_truncated: bool | None = None,
              fallback: str | None = None, error: str | None = None) -> list[dict[str, Any]]:
    """``CARDS`` rows of one session; tokens go on card 0 only (the column then sums to the cost)."""
    return [{
        "card_id": card_id(session_hash, extractor, k), "session_hash": session_hash, "extractor": extractor,
        "card_index": k, "text": c.text, "text_hash": text_hash(c.text), "type": c.type, "time": c.time,
        "turn_start": c.turn_start, "turn_end": c.turn_end,
        "prompt_tokens": prompt_tokens if k == 0 else None,
        "completion_tokens": completion_tokens if k == 0 else None,
        "input_truncated": input_truncated, "fallback": fallback, "error": error,
    } for k, c in enumerate(cards)]


def extract_cards(
    sessions: Sequence[tuple[str, Sequence[Turn], str | None]],
    cfg: JustMemConfig,
    *,
    key: str,
    llm: LLM | None = None,
    ledger: TokenLedger | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> pa.Table:
    """``CARDS`` rows for ``sessions`` = ``(session_hash, turns, dataset or dialogue kind)``, under extractor
    ``key`` (:func:`extractor_key`), in session order then card order. Never raises for a bad session:
    with ``cfg.extractor == "llm"`` an output still invalid after one repair is replaced by the LLM-free cards
    of that session, with ``fallback`` naming why; the ledger counts them. A session whose call failed in the
    backend (:attr:`StructuredResult.failed`) gets no row: nothing under the LLM key, so the next run extracts
    it again (the cards stage counts it as a failure)."""
    rows: list[dict[str, Any]] = []
    if cfg.extractor == "llm-free":
        for h, turns, _ in sessions:
            rows += card_rows(h, key, extract_llm_free(turns))
        if ledger is not None:
            ledger.count("justmem-cards-llm-free", "sessions", len(sessions))
        return pa.Table.from_pylist(rows, schema=CARDS)
    if llm is None:
        raise ValueError("justmem.extractor=llm needs an LLM")
    todo = [(h, list(turns), kind) for h, turns, kind in sessions if any(t.content.strip() for t in turns)]
    fitted = [_fit_turns(llm, turns, cfg.extract_max_input_tokens) for _, turns, _ in todo]
    prompts = [justmem_extract_prompt(justmem_numbered_turns([(t.turn_index, t.role, t.content) for t in shown]),
                                      dialogue_kind_for(kind), [t.role for t in shown])
               for (shown, _), (_, _, kind) in zip(fitted, todo)]
    # each session's reply is bounded by its own schema (its turn numbers, a card budget that fits the output
    # tokens); sessions whose schemas are equal share one call_structured (one batch on the backend)
    schemas = [session_cards_schema(shown, card_budget(llm, shown, cfg.extract_max_tokens)) for shown, _ in fitted]
    groups: dict[str, list[int]] = {}
    for i, schema in enumerate(schemas):
        groups.setdefault(json.dumps(schema, sort_keys=True), []).append(i)
    results: list[StructuredResult] = [StructuredResult() for _ in todo]
    for idx in groups.values():
        params = SamplingParams(max_tokens=cfg.extract_max_tokens, temperature=temperature, seed=seed,
                                json_schema=schemas[idx[0]])
        got = call_structured(llm, [prompts[i] for i in idx],
                              lambda obj, k, idx=idx: grounded_cards(obj, fitted[idx[k]][0]),
                              params, ledger=ledger, stage="justmem-cards")
        for i, r in zip(idx, got):
            results[i] = r
    by_hash: dict[str, list[dict[str, Any]]] = {}
    n_fallback = n_failed = n_dropped = 0
    for (h, turns, _), (_, truncated), res in zip(todo, fitted, results):
        tokens = dict(prompt_tokens=res.prompt_tokens, completion_tokens=res.completion_tokens,
                      input_truncated=truncated)
        if res.failed:
            n_failed += 1
            log.warning("justmem cards: session %s: %s; nothing stored, the next run retries it", h[:12], res.error)
        elif res.value is not None:
            kept, dropped = res.value
            n_dropped += len(dropped)
            note = (f"dropped {len(dropped)} of {len(kept) + len(dropped)} cards: {'; '.join(dropped)}"
                    if dropped else None)
            by_hash[h] = card_rows(h, key, kept, error=note, **tokens)
        else:
            n_fallback += 1
            log.warning("justmem cards: session %s: %s; LLM-free cards used", h[:12], res.error)
            by_hash[h] = card_rows(h, key, extract_llm_free(turns), fallback=f"{LLM_FREE_EXTRACTOR} ({res.error})",
                                   **tokens)
    for h, _, _ in sessions:
        rows += by_hash.get(h, [])
    if ledger is not None:
        ledger.count("justmem-cards", "fallback", n_fallback)
        if n_dropped:
            ledger.count("justmem-cards", "dropped-ungrounded", n_dropped)
        if n_failed:
            ledger.count("justmem-cards", "failed", n_failed)
        ledger.count("justmem-cards", "sessions", len(todo))
    return pa.Table.from_pylist(rows, schema=CARDS)


def turns_by_session(turns: pa.Table) -> dict[str, list[Turn]]:
    """``turns`` table rows -> {session_hash: turns in turn_index order}."""
    out: dict[str, list[Turn]] = {}
    cols = [turns.column(c).to_pylist() for c in ("session_hash", "turn_index", "role", "content")]
    for h, i, role, content in zip(*cols):
        out.setdefault(h, []).append(Turn(int(i), role, content))
    for v in out.values():
        v.sort(key=lambda t: t.turn_index)
    return out
