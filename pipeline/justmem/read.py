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
from typing import Any

import pyarrow as pa
from memgas.pipeline.accounting import TokenLedger
from memgas.pipeline.config import ReadingConfig
from memgas.pipeline.justmem.extract import turns_by_session
from memgas.pipeline.justmem.text import Turn
from memgas.pipeline.justmem.times import fmt_date, resolve_time
from memgas.pipeline.llm_calls import generate_batch
from memgas.pipeline.models.base import LLM, ChatPrompt, SamplingParams
from memgas.pipeline.prompts import justmem_answer_prompt, justmem_card_line
from memgas.pipeline.read import ANSWER_FAILED, MARGIN, clean_answer, usable
from memgas.pipeline.schema import ANSWERS


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
    rec = None
    if replay:
        if turns is None:
            raise ValueError("Replay needs the sessions' turns")
        rec = recover_turns(cards, turns, replay_tokens, count_tokens)
    prompt = justmem_answer_prompt(card_block(cards), rec.text if rec else "", question, question_date, operation)
    return prompt, count_tokens(prompt[0]["content"]), rec


def card_block(cards: Sequence[ReadCard]) -> str:
    """The cards as the answer prompt lists them, one numbered line each, in final order."""
    return "\n".join(justmem_card_line(k + 1, _date_str(c), resolve_time(c.time, c.session_date), c.text)
                     for k, c in enumerate(cards))


@dataclass
class CardContext:
    """What the answer model is given for one question: the prompt, its tokens, the cards that fit (in final
    order), Replay's recovery (or None), and whether cards were dropped to fit the window."""

    prompt: ChatPrompt
    tokens: int
    cards: list[ReadCard]
    replay: Replay | None
    cut: bool

    def turn_keys(self) -> list[tuple[str, int]]:
        """``(session_hash, turn_index)`` of the cards' provenance spans (each once, in card order); Replay's
        recovered turns are among them."""
        keys = [(c.session_hash, i) for c in self.cards for i in range(c.turn_start, c.turn_end + 1)]
        return list(dict.fromkeys(keys))

    def verbatim_keys(self) -> list[tuple[str, int]]:
        """``(session_hash, turn_index)`` of the turns whose own text is in the prompt (Replay's recovery)."""
        return list(self.replay.turns) if self.replay is not None else []

    def context_tokens(self, count_tokens: Callable[[str], int]) -> int:
        """Tokens of the memory in the prompt: the card lines, plus Replay's recovered turns."""
        return count_tokens(card_block(self.cards)) + (self.replay.tokens if self.replay is not None else 0)


def fit_cards(q: Mapping[str, Any], count_tokens: Callable[[str], int], window: int,
              replay_tokens: int) -> CardContext:
    """The answer prompt of query ``q`` (a :func:`card_reading_payloads` entry) within ``window`` tokens
    (what is left of the reader's context after the output budget and the margin): the lowest-ranked cards
    are dropped first until it fits."""
    cards = list(q["cards"])
    while True:
        prompt, n, rec = reading_prompt(q["question"], q.get("question_date"), q["operation"], cards, count_tokens,
                                        replay=q["profile"] == "replay", turns=q.get("turns"),
                                        replay_tokens=replay_tokens)
        if n <= window or not cards:
            break
        cards.pop()  # lowest-ranked first
    return CardContext(prompt, n, cards, rec, len(cards) < len(q["cards"]))


def card_reading_payloads(bank: Any, rankings: pa.Table, picks: pa.Table, query_ids: Sequence[str], *,
                          method: str, planner: str) -> list[dict[str, Any]]:
    """Inputs of :func:`read_and_answer_cards` for one method: per query (``query_ids`` order) its chosen
    cards (``picks``: ``CARD_PICKS`` rows of ``method``, in rank order) as :class:`ReadCard` with the date of
    their session in the query's history (a session text repeated in one history: its first position), the
    planner's operation (``plans`` rows of ``planner``), the method's ranked sessions (``rankings``: its top-K)
    and, for Replay, the chosen cards' sessions' turns. A query without picks (a history without cards) reads
    no cards under its method's fixed profile, else the plan's."""
    import pyarrow.compute as pc
    from memgas.pipeline.justmem.retrieve import FIXED_PROFILE

    qids = list(query_ids)
    queries = {r["query_id"]: r for r in bank.read(
        "queries", ["query_id", "history_id", "question", "question_date_raw"],
        filter=pc.field("query_id").isin(qids)).to_pylist()}
    plans = {r["query_id"]: r for r in bank.read(
        "plans", ["query_id", "operation", "profile"],
        filter=(pc.field("planner") == planner) & pc.field("query_id").isin(qids)).to_pylist()}
    missing = [q for q in qids if q not in plans]
    if missing:
        raise KeyError(f"no JustMem plan for query {missing[0]!r} under planner {planner!r}")
    top: dict[str, list[str]] = {}
    for r in rankings.sort_by([("query_id", "ascending"), ("rank", "ascending")]).to_pylist():
        top.setdefault(r["query_id"], []).append(r["session_id"])
    chosen: dict[str, list[tuple[str, str]]] = {}
    for r in picks.filter(pc.field("method") == method).sort_by([("query_id", "ascending"),
                                                                  ("rank", "ascending")]).to_pylist():
        chosen.setdefault(r["query_id"], []).append((r["card_id"], r["profile"]))
    card_ids = sorted({c for v in chosen.values() for c, _ in v})
    cards = {r["card_id"]: r for r in bank.read(
        "cards", ["card_id", "session_hash", "text", "time", "turn_start", "turn_end"],
        filter=pc.field("card_id").isin(card_ids)).to_pylist()} if card_ids else {}
    lost = [c for c in card_ids if c not in cards]
    if lost:
        raise KeyError(f"card {lost[0]!r} was picked by the rank stage but is not in the bank's cards")
    hids = sorted({q["history_id"] for q in queries.values()})
    dates: dict[tuple[str, str], tuple[datetime | None, str | None]] = {}
    for r in bank.read("sessions", ["history_id", "position", "text_hash", "date", "date_raw"],
                       filter=pc.field("history_id").isin(hids)).sort_by(
            [("history_id", "ascending"), ("position", "ascending")]).to_pylist():
        dates.setdefault((r["history_id"], r["text_hash"]), (r["date"], r["date_raw"]))
    profiles = {q: (v[0][1] if v else FIXED_PROFILE.get(method) or plans[q]["profile"]) for q, v in
                ((q, chosen.get(q, [])) for q in qids)}
    replay_hashes = sorted({cards[c]["session_hash"] for q in qids if profiles[q] == "replay"
                            for c, _ in chosen.get(q, [])})
    turns = turns_by_session(bank.read("turns", ["session_hash", "turn_index", "role", "content"],
                                       filter=pc.field("session_hash").isin(replay_hashes))) if replay_hashes else {}
    payload = []
    for qid in qids:
        q = queries[qid]
        read_cards = []
        for cid, _ in chosen.get(qid, []):
            c = cards[cid]
            date, raw = dates.get((q["history_id"], c["session_hash"]), (None, None))
            read_cards.append(ReadCard(c["text"], c["session_hash"], c["turn_start"], c["turn_end"], date, c["time"],
                                       raw))
        entry = {"query_id": qid, "question": q["question"], "question_date": q["question_date_raw"],
                 "operation": plans[qid]["operation"], "profile": profiles[qid], "cards": read_cards,
                 "session_ids": top.get(qid, [])}
        if profiles[qid] == "replay":
            entry["turns"] = {h: turns[h] for h in sorted({c.session_hash for c in read_cards})}
        payload.append(entry)
    return payload


def read_and_answer_cards(
    queries: Sequence[Mapping[str, Any]],
    llm: LLM,
    reading: ReadingConfig,
    replay_tokens: int,
    method: str,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    ledger: TokenLedger | None = None,
) -> pa.Table:
    """Answer ``queries`` from their chosen cards (one batched LLM call, no filter step: a card is already one
    statement). Each query: ``query_id``, ``question``, ``question_date``, ``operation`` (the planner's),
    ``profile`` (lookup / compose / replay: the method's access for this query), ``cards`` (:class:`ReadCard` in final order), ``session_ids`` (the method's
    ranked sessions, for ``retrieved_session_ids``) and, for Replay, ``turns`` ({session_hash: turns}).

    Budget as in MemGAS reading: prompt + ``max_new_tokens`` within ``min(reading.context_tokens,
    llm.context_tokens)``; Replay's turns take at most ``replay_tokens`` of it; when the prompt does not fit,
    the lowest-ranked cards are dropped first (noted in ``error``, counted as ``context_cut``). Returns an
    ``ANSWERS`` table, one row per query in input order; ``filtered_context`` holds what the model read."""
    window = min(reading.context_tokens, llm.context_tokens) - reading.max_new_tokens - MARGIN
    rows, prompts, errors, n_cut = [], [], [], 0
    for q in queries:
        errs: list[str] = []
        fit = fit_cards(q, llm.count_tokens, window, replay_tokens)
        prompt, cards, rec = fit.prompt, fit.cards, fit.replay
        if fit.cut:
            n_cut += 1
            errs.append(f"context cut to {len(cards)} card(s)")  # noted, not a failure
        if rec is not None and rec.cut:
            errs.append(f"replay cut to {len(rec.turns)} turn(s) by justmem.replay_tokens")
        rows.append({"method": method, "query_id": str(q["query_id"]),
                     "retrieved_session_ids": [str(s) for s in q.get("session_ids") or []][: reading.top_k],
                     "filtered_context": prompt[0]["content"], "hypothesis": None, "prompt_tokens": 0,
                     "completion_tokens": 0, "error": None})
        prompts.append(prompt)
        errors.append(errs)
    params = SamplingParams(max_tokens=reading.max_new_tokens, temperature=temperature, seed=seed)
    n_fail = 0
    for row, errs, r in zip(rows, errors, generate_batch(llm, prompts, params, ledger, "reading-answer")):
        row["prompt_tokens"], row["completion_tokens"], row["hypothesis"] = r.prompt_tokens, r.completion_tokens, ""
        if r.error is not None:
            errs.append(f"{ANSWER_FAILED} {r.error}")
            n_fail += 1
        elif usable(ans := clean_answer(r.text)):
            row["hypothesis"] = ans
        else:
            errs.append(f"answer unusable: {r.text[:80]!r}")
            n_fail += 1
        row["error"] = "; ".join(errs) if errs else None
    if ledger is not None:
        ledger.count("reading-answer", "context_cut", n_cut)
        ledger.count("reading-answer", "unanswered", n_fail)
    return pa.Table.from_pylist(rows, schema=ANSWERS)
