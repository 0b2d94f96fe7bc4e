"""JustMem reading: the answer prompt from the K chosen cards, the planner's operation and, for Replay, the
source turns recovered through the cards' provenance within ``justmem.replay_tokens``.

Replay recovery: for the chosen cards in their final order, the turns ``turn_start..turn_end`` of the card's
session (``turns`` table), each turn once; turns are added while the rendered source text stays within the
budget (reader's tokenizer), and recovery stops at the first turn that does not fit, so higher-ranked cards'
sources come first and a cut is reported. The recovered turns are shown grouped by session, in the cards'
order, each session under its date.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from memgas.pipeline.justmem.extract import Turn, fmt_date, resolve_time
from memgas.pipeline.models.base import ChatPrompt
from memgas.pipeline.prompts import justmem_answer_prompt, justmem_card_line


@dataclass(frozen=True)
class ReadCard:
    """A chosen card as the reader needs it: text and time, and where it came from."""

    text: str
    session_hash: str
    turn_start: int
    turn_end: int
    #: the date of the card's session in the history being read (None: unknown)
    session_date: datetime | None = None
    #: the card's own time, relative to the session date (``cards.time``)
    time: str | None = None
    #: the session's date as the dataset wrote it (shown when ``session_date`` is None)
    date_raw: str | None = None


@dataclass
class Replay:
    """Turns recovered for Replay: keys ``(session_hash, turn_index)`` in reading order, their text, tokens."""

    turns: list[tuple[str, int]]
    text: str
    tokens: int
    #: some provenance turn did not fit the budget
    cut: bool


def _date_str(c: ReadCard) -> str | None:
    return fmt_date(c.session_date) if c.session_date is not None else c.date_raw


def recover_turns(cards: Sequence[ReadCard], turns: Mapping[str, Sequence[Turn]], budget: int,
                  count_tokens: Callable[[str], int]) -> Replay:
    """The source turns of ``cards`` within ``budget`` tokens (module docstring)."""
    by_index = {h: {t.turn_index: t for t in ts} for h, ts in turns.items()}
    keys: list[tuple[str, int]] = []
    seen: set[tuple[str, int]] = set()
    for c in cards:
        if c.session_hash not in by_index:
            raise KeyError(f"no turns for session {c.session_hash}: a card's provenance must point at real turns")
        for i in range(c.turn_start, c.turn_end + 1):
            if i not in by_index[c.session_hash]:
                raise KeyError(f"session {c.session_hash} has no turn {i}: a card's provenance must point at real turns")
            if (c.session_hash, i) not in seen:
                seen.add((c.session_hash, i))
                keys.append((c.session_hash, i))
    date_of = {}
    for c in cards:
        date_of.setdefault(c.session_hash, _date_str(c))
    kept: list[tuple[str, int]] = []
    text, tokens, cut = "", 0, False
    for k in keys:
        trial = _render([*kept, k], by_index, date_of)
        n = count_tokens(trial)
        if n > budget:
            cut = True
            break
        kept, text, tokens = [*kept, k], trial, n
    return Replay(kept, text, tokens, cut)


def _render(keys: Sequence[tuple[str, int]], by_index: Mapping[str, Mapping[int, Turn]],
            date_of: Mapping[str, str | None]) -> str:
    groups: dict[str, list[int]] = {}
    for h, i in keys:
        groups.setdefault(h, []).append(i)
    blocks = []
    for h, idx in groups.items():
        lines = [f"[{i}] {by_index[h][i].role}: {by_index[h][i].content}" for i in sorted(idx)]
        blocks.append(f"### Session date: {date_of.get(h) or 'unknown'}\n" + "\n".join(lines))
    return "\n\n".join(blocks)


def reading_prompt(
    question: str,
    question_date: str | None,
    operation: str,
    cards: Sequence[ReadCard],
    count_tokens: Callable[[str], int],
    *,
    replay: bool = False,
    turns: Mapping[str, Sequence[Turn]] | None = None,
    replay_tokens: int = 0,
) -> tuple[ChatPrompt, int, Replay | None]:
    """The JustMem answer prompt for one question: (prompt, its tokens by ``count_tokens``, the Replay
    recovery or None). ``cards`` in final order; ``replay`` needs ``turns`` ({session_hash: turns}) and
    ``replay_tokens`` (``justmem.replay_tokens``)."""
    lines = [justmem_card_line(k + 1, _date_str(c), resolve_time(c.time, c.session_date), c.text)
             for k, c in enumerate(cards)]
    rec = None
    if replay:
        if turns is None:
            raise ValueError("Replay needs the sessions' turns")
        rec = recover_turns(cards, turns, replay_tokens, count_tokens)
    prompt = justmem_answer_prompt("\n".join(lines), rec.text if rec else "", question, question_date, operation)
    return prompt, count_tokens(prompt[0]["content"]), rec
