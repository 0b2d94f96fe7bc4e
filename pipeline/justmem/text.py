"""JustMem card text: the turns and cards the extractors share, and the words and sentences of their text.

What both card extractors (:mod:`.extract`, LLM-free and LLM) and the checks of an LLM reply
(:mod:`.llm_cards`) read: content words (sklearn's English stop words, chat interjections and auxiliaries
left out), the speaker label a card starts with, sentences, the code/list blocks of a turn, and word-boundary
cuts of a long text.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

#: Longest card text, in characters, on both paths: an LLM card longer than this is invalid (a "card" that long
#: is a copy of the session, not a card); the LLM-free extractor cuts longer text on word boundaries into
#: several cards of the same turn span.
CARD_TEXT_LIMIT = 4000


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


# sklearn's English stop words plus chat interjections: words that carry no memory on their own
_INTERJECTIONS = frozenset(
    "hey hi hello wow yeah yes yep nope thanks thank haha hahaha lol omg cool awesome great nice good glad "
    "totally really sure okay amazing congrats congratulations bye see soon hear sounds awesome wonderful "
    "fantastic sweet lovely true absolutely definitely agree welcome talk later chat care".split())
# auxiliaries sklearn's list lacks ("do" is there, "did"/"does" are not)
_AUX = frozenset("did does doing done has had having got gets getting gonna wanna let lets".split())
_WORD_RE = re.compile(r"[A-Za-z][A-Za-z'’]+")
_FENCE_BLOCK_RE = re.compile(r"```.*?(?:```|\Z)", re.DOTALL)
_LIST_LINE_RE = re.compile(r"^\s*(?:[-*•·]|\d{1,3}[.)])\s+\S")
#: words after which a period does not end a sentence
_ABBREV = frozenset("mr mrs ms dr st vs etc e.g i.e jr sr prof no approx".split())
_SENT_BOUNDARY_RE = re.compile(r"([.!?]+)([\"')\]]*)\s+")

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


@functools.cache
def stop_words() -> frozenset[str]:
    """sklearn's English stop words, interjections and auxiliaries. sklearn is imported at the first call, not
    with this module: a command that only names the planner (``memgas index``'s fingerprints) does without
    its import (~1 s)."""
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

    return frozenset(ENGLISH_STOP_WORDS) | _INTERJECTIONS | _AUX


def content_words(text: str) -> list[str]:
    """Words of three letters or more that are neither stop words nor interjections ("Melanie's" -> melanie)."""
    stop = stop_words()
    words = (m.group(0).lower().replace("’", "'").removesuffix("'s") for m in _WORD_RE.finditer(text))
    return [w for w in words if len(w) >= 3 and w not in stop and w.split("'")[0] not in stop]



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

