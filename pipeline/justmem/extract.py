"""JustMem cards: atomic memory cards per unique session, LLM-free (the CPU default) or by one LLM call.

A card is one statement with its subject explicit, a type, a time relative to the session's date, and the
inclusive span of ``turn_index`` values it comes from (its provenance, what Replay recovers). Cards are keyed
by content: :func:`card_id` hashes (session_hash, extractor key, card_index), so a session shared by many
histories is extracted once, and a changed extractor (method version, model, prompt) writes new keys.

LLM-free method (``LLM_FREE_EXTRACTOR``, v3 "compact cards"; measured on LoCoMo and LongMemEval-S in
docs/benchmarks.md, through the job). A card should hold what a speaker states about
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
turns its span names (:func:`.llm_cards.grounding` is 100% on both bundled samples): cards are cut and joined from the
turns' own text, never rewritten. On the LongMemEval-S sample: 16.9 cards per session instead of 56 (v2), a
quarter of v2's encoder input tokens (611,394 against 2,450,385).

Types (first rule that matches): ``interaction`` for code/list cards and assistant turns; ``preference`` for
likes/loves/enjoys/prefers/favourite/hates; ``event`` when the card holds a time expression or an event verb
(went, visited, attended, joined, started, ...); ``state`` for "I am/I'm/I have/I feel/currently/these days";
``fact`` otherwise. ``time`` is the card's first time expression ("yesterday", "last week", "two weeks ago",
"2022"), lower-cased; null means the session's date. :func:`.times.resolve_time` turns it into a date or a phrase
against the session date of the history being read ("yesterday" on 8 May 2023 -> "7 May 2023").
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memgas.pipeline.accounting import TokenLedger
from memgas.pipeline.config import JustMemConfig
from memgas.pipeline.data.locomo import CAPTION_SEP
from memgas.pipeline.hashing import text_hash
from memgas.pipeline.justmem.llm_cards import card_budget, grounded_cards, schema_digest, session_cards_schema
from memgas.pipeline.justmem.structured import StructuredResult, call_structured
from memgas.pipeline.justmem.text import (
    _LIST_LINE_RE,
    CARD_TEXT_LIMIT,
    Card,
    Turn,
    _is_assistant,
    _speaker,
    content_words,
    cut_words,
    split_blocks,
    split_sentences,
)
from memgas.pipeline.justmem.times import find_time
from memgas.pipeline.models.base import LLM, SamplingParams
from memgas.pipeline.prompts import (
    JUSTMEM_EXTRACT_PROMPT_DIGEST,
    dialogue_kind_for,
    justmem_extract_prompt,
    justmem_numbered_turns,
)
from memgas.pipeline.schema import CARDS

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
    (docs/benchmarks.md); the extractor key names the defaults only."""
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
# LLM extractor
# --------------------------------------------------------------------------------------------------



#: What keys the LLM extractor's outputs beside the model and the config: the prompt (wording and version)
#: and the reply schema with its budget constants. The one place both the ``extractor`` column
#: (:func:`extractor_key`) and the cards stage's fingerprint (jobs/keys.py) take it from.
LLM_EXTRACTOR_VERSION = f"{JUSTMEM_EXTRACT_PROMPT_DIGEST}|{schema_digest()}"



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
    of that session, with ``fallback`` naming why; the ledger counts them. A valid reply's cards that fail the
    checks of :func:`.llm_cards.card_problem` are dropped, named in the session's ``error`` note and counted by
    kind (ledger ``dropped-ungrounded``, ``dropped-repeated``, ``dropped-cut-off``). A session whose call
    failed in the backend (:attr:`StructuredResult.failed`) gets no row: nothing under the LLM key, so the next
    run extracts it again (the cards stage counts it as a failure)."""
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
    budgets = [card_budget(llm, shown, cfg.extract_max_tokens) for shown, _ in fitted]
    schemas = [session_cards_schema(shown, b) for (shown, _), b in zip(fitted, budgets)]
    groups: dict[str, list[int]] = {}
    for i, schema in enumerate(schemas):
        groups.setdefault(json.dumps(schema, sort_keys=True), []).append(i)
    results: list[StructuredResult] = [StructuredResult() for _ in todo]
    for idx in groups.values():
        params = SamplingParams(max_tokens=cfg.extract_max_tokens, temperature=temperature, seed=seed,
                                json_schema=schemas[idx[0]])
        got = call_structured(llm, [prompts[i] for i in idx],
                              lambda obj, k, idx=idx: grounded_cards(obj, fitted[idx[k]][0],
                                                                     budgets[idx[k]].text_chars),
                              params, ledger=ledger, stage="justmem-cards")
        for i, r in zip(idx, got):
            results[i] = r
    by_hash: dict[str, list[dict[str, Any]]] = {}
    n_fallback = n_failed = 0
    n_dropped: dict[str, int] = {}
    for (h, turns, _), (_, truncated), res in zip(todo, fitted, results):
        tokens = dict(prompt_tokens=res.prompt_tokens, completion_tokens=res.completion_tokens,
                      input_truncated=truncated)
        if res.failed:
            n_failed += 1
            log.warning("justmem cards: session %s: %s; nothing stored, the next run retries it", h[:12], res.error)
        elif res.value is not None:
            kept, dropped = res.value
            for kind, _ in dropped:
                n_dropped[kind] = n_dropped.get(kind, 0) + 1
            note = (f"dropped {len(dropped)} of {len(kept) + len(dropped)} cards: {'; '.join(m for _, m in dropped)}"
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
        for kind, n in sorted(n_dropped.items()):
            ledger.count("justmem-cards", f"dropped-{kind}", n)
        if n_failed:
            ledger.count("justmem-cards", "failed", n_failed)
        ledger.count("justmem-cards", "sessions", len(todo))
    return pa.Table.from_pylist(rows, schema=CARDS)


_DROPPED_NOTE_RE = re.compile(r"dropped (\d+) of \d+ cards: ")


def dropped_cards(cards: pa.Table) -> int:
    """Cards the LLM wrote and the checks dropped (:func:`.llm_cards.card_problem`), in ``CARDS`` rows: each
    session's rows carry the note "dropped N of M cards: ..." that :func:`extract_cards` writes."""
    first = cards.filter(pc.equal(cards["card_index"], 0))["error"].to_pylist()
    return sum(int(m.group(1)) for m in (_DROPPED_NOTE_RE.match(e or "") for e in first) if m)


def turns_by_session(turns: pa.Table) -> dict[str, list[Turn]]:
    """``turns`` table rows -> {session_hash: turns in turn_index order}."""
    out: dict[str, list[Turn]] = {}
    cols = [turns.column(c).to_pylist() for c in ("session_hash", "turn_index", "role", "content")]
    for h, i, role, content in zip(*cols):
        out.setdefault(h, []).append(Turn(int(i), role, content))
    for v in out.values():
        v.sort(key=lambda t: t.turn_index)
    return out
