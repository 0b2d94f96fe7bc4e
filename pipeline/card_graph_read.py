"""memgas-cards' reading: MemGAS's reader (:mod:`memgas.pipeline.read`: the filter and answer prompts, the
reading budget) over the method's top sessions, each session's block holding, after its text, the cards that
ranked it (``card_graph_picks``: the session's cards of most PPR mass) as JustMem's card lines (their session's
date, their own event time resolved against it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memgas.pipeline.justmem.read import ReadCard, card_block
from memgas.pipeline.read import reading_payloads


def card_graph_reading_payloads(bank: Any, rankings: pa.Table, picks: pa.Table, query_ids: Sequence[str], *,
                                generation_key: tuple[str, str] | None) -> list[dict[str, Any]]:
    """:func:`memgas.pipeline.read.reading_payloads` of one method's top-K ``rankings``, each session with
    ``cards``: the lines of its picks (``picks``: that method's ``CARD_GRAPH_PICKS`` rows, in ``card_rank``
    order), or None when it has none. Raises KeyError for a picked card the bank's cards do not hold."""
    payload = reading_payloads(bank, rankings, query_ids, generation_key=generation_key)
    chosen: dict[tuple[str, str], list[str]] = {}
    for r in picks.sort_by([("query_id", "ascending"), ("rank", "ascending"), ("card_rank", "ascending")]).select(
            ["query_id", "session_id", "card_id"]).to_pylist():
        chosen.setdefault((r["query_id"], r["session_id"]), []).append(r["card_id"])
    ids = sorted({c for v in chosen.values() for c in v})
    if not ids:
        return payload
    cards = {r["card_id"]: r for r in bank.read("cards", ["card_id", "session_hash", "text", "time", "turn_start",
                                                          "turn_end"], filter=pc.field("card_id").isin(ids)).to_pylist()}
    lost = [c for c in ids if c not in cards]
    if lost:
        raise KeyError(f"card {lost[0]!r} was picked by card-graph-rank but is not in the bank's cards")
    history = {r["query_id"]: r["history_id"] for r in bank.read(
        "queries", ["query_id", "history_id"], filter=pc.field("query_id").isin(list(query_ids))).to_pylist()}
    dates = {(r["history_id"], r["session_id"]): (r["date"], r["date_raw"]) for r in bank.read(
        "sessions", ["history_id", "session_id", "date", "date_raw"],
        filter=pc.field("history_id").isin(sorted(set(history.values())))).to_pylist()}
    for q in payload:
        h = history[q["query_id"]]
        for s in q["sessions"]:
            date, raw = dates[(h, s["session_id"])]
            read = [ReadCard(cards[c]["text"], cards[c]["session_hash"], cards[c]["turn_start"], cards[c]["turn_end"],
                             date, cards[c]["time"], raw) for c in chosen.get((q["query_id"], s["session_id"]), [])]
            s["cards"] = card_block(read) if read else None
    return payload
