"""Dataset statistics of an ingested bank: sizes, sharing of sessions, question types, evidence coverage.

Tokens are *estimated* as characters / 4 (a common rule of thumb for English with BPE tokenizers); no
tokenizer is loaded, so the numbers are for sizing only.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memgas.pipeline.bank import Bank

CHARS_PER_TOKEN = 4


def compute_stats(bank: Bank) -> dict[str, Any]:
    """Statistics of the ingested tables of ``bank`` (reads one part of ``texts`` at a time)."""
    histories = bank.read("histories", ["history_id", "dataset"])
    sessions = bank.read("sessions", ["history_id", "text_hash"])
    queries = bank.read("queries", ["question_type", "evidence_session_ids", "evidence_turn_ids", "is_abstention"])

    session_hashes = pc.unique(sessions.column("text_hash")) if sessions.num_rows else pa.array([], pa.string())
    # chars of every unique session text, streamed part by part so pair texts are never all in memory
    chars: dict[str, int] = {}
    for part in bank.parts("texts"):
        t = bank.read("texts", parts=[part], dedupe=False)
        t = t.filter(pc.is_in(t.column("text_hash"), value_set=session_hashes))
        lengths = pc.utf8_length(t.column("text")).to_pylist()
        chars.update(zip(t.column("text_hash").to_pylist(), lengths))

    unique_chars = sum(chars.values())
    per_history: Counter[str] = Counter()
    ref_chars = 0
    for hid, h in zip(sessions.column("history_id").to_pylist(), sessions.column("text_hash").to_pylist()):
        c = chars.get(h, 0)
        per_history[hid] += c
        ref_chars += c

    n_refs = sessions.num_rows
    n_unique = len(session_hashes)
    ev_sessions = pc.list_value_length(queries.column("evidence_session_ids")).fill_null(0) if queries.num_rows else None
    ev_turns = pc.list_value_length(queries.column("evidence_turn_ids")).fill_null(0) if queries.num_rows else None
    hist_tokens = [v / CHARS_PER_TOKEN for v in per_history.values()]
    datasets = [d for d in bank.manifest.get("datasets", []) if isinstance(d, dict)]
    return {
        "datasets": [d.get("path") for d in datasets],
        # sessions a dataset lists twice in one history (same id, same content): kept once at ingest
        "repeated_sessions": sum(int((d.get("counts") or {}).get("repeated_sessions", 0)) for d in datasets),
        "ingest_warnings": sum(int(d.get("warnings", 0) or 0) for d in datasets),
        "histories": histories.num_rows,
        "histories_by_dataset": dict(sorted(Counter(histories.column("dataset").to_pylist()).items())),
        "sessions": n_refs,
        "unique_sessions": n_unique,
        "dedup_ratio": round(n_refs / n_unique, 4) if n_unique else None,
        "sessions_per_history": round(n_refs / histories.num_rows, 2) if histories.num_rows else None,
        "turns": bank.count("turns"),
        "pairs": bank.count("pairs"),
        "texts": bank.count("texts"),
        "queries": queries.num_rows,
        "queries_by_type": dict(sorted(Counter(queries.column("question_type").to_pylist()).items())),
        "queries_with_evidence": int(pc.sum(pc.greater(ev_sessions, 0)).as_py() or 0) if ev_sessions is not None else 0,
        "queries_with_turn_evidence": int(pc.sum(pc.greater(ev_turns, 0)).as_py() or 0) if ev_turns is not None else 0,
        "abstentions": int(pc.sum(queries.column("is_abstention")).as_py() or 0) if queries.num_rows else 0,
        "tokens_estimate": "chars/4",
        "tokens_unique_sessions": round(unique_chars / CHARS_PER_TOKEN),
        "tokens_session_references": round(ref_chars / CHARS_PER_TOKEN),
        "tokens_per_history_mean": round(sum(hist_tokens) / len(hist_tokens)) if hist_tokens else 0,
        "tokens_per_history_max": round(max(hist_tokens)) if hist_tokens else 0,
    }


def format_stats(d: dict[str, Any]) -> str:
    """A readable two-column table of :func:`compute_stats` output."""
    rows: list[tuple[str, str]] = []

    def add(label: str, value: Any) -> None:
        if isinstance(value, float):
            value = f"{value:,.3f}"
        elif isinstance(value, int):
            value = f"{value:,}"
        rows.append((label, "-" if value is None else str(value)))

    add("histories", d["histories"])
    for ds, n in d.get("histories_by_dataset", {}).items():
        add(f"  {ds}", n)
    add("sessions (references)", d["sessions"])
    add("  repeats dropped at ingest", d.get("repeated_sessions", 0))
    add("unique sessions", d["unique_sessions"])
    add("dedup ratio (refs / unique)", d["dedup_ratio"])
    add("sessions per history", d["sessions_per_history"])
    add("utterances (turns table)", d["turns"])
    add("turn pairs (pairs table)", d["pairs"])
    add("unique texts", d["texts"])
    add("queries", d["queries"])
    for qt, n in d.get("queries_by_type", {}).items():
        add(f"  {qt}", n)
    add("queries with evidence sessions", d["queries_with_evidence"])
    add("queries with evidence turns", d["queries_with_turn_evidence"])
    add("abstention queries", d["abstentions"])
    add("tokens, unique sessions (chars/4)", d["tokens_unique_sessions"])
    add("tokens, all references (chars/4)", d["tokens_session_references"])
    add("tokens per history, mean", d["tokens_per_history_mean"])
    add("tokens per history, max", d["tokens_per_history_max"])
    add("ingest warnings", d.get("ingest_warnings", 0))
    width = max(len(k) for k, _ in rows)
    vwidth = max(len(v) for _, v in rows)
    line = "-" * (width + vwidth + 3)
    return "\n".join([line, *(f"{k:<{width}}   {v:>{vwidth}}" for k, v in rows), line])
