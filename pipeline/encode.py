"""Encoding stage: embed every text the memory nodes and the queries need, once per encoder.

Which texts: session texts, turn-pair texts, and, when the ``nodes`` table exists, the summary, keyword
and hybrid texts it names (else every derived text the generation stage added to ``texts``); plus the
queries' question texts. Questions are added to ``texts`` (key ``text_hash(question)``) so that query
vectors live in ``embeddings`` like everything else and a re-run or another method reuses them: the
retrieval stage looks a query's vector up by ``text_hash(question)`` (see :func:`query_hash`).

Cache key ``(text_hash, encoder.name)``: a re-run encodes nothing. New vectors are written as parts
named from their content (``emb-<encoder>-<digest of the hashes>``), at most ``part_rows`` rows each, so a
killed run keeps its finished parts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memgas.pipeline.accounting import TokenLedger
from memgas.pipeline.bank import Bank
from memgas.pipeline.generate import digest, slug
from memgas.pipeline.hashing import text_hash
from memgas.pipeline.models.base import Encoder
from memgas.pipeline.schema import TEXTS, embeddings_schema

log = logging.getLogger(__name__)


def query_hash(question: str) -> str:
    """Key of a query's vector in ``embeddings`` (the question text's hash)."""
    return text_hash(question)


def add_query_texts(bank: Bank) -> list[str]:
    """Add every question of ``queries`` to ``texts``; returns their hashes (sorted, unique)."""
    if not bank.exists("queries"):
        return []
    qs = bank.read("queries", ["query_id", "question"]).column("question").to_pylist()
    rows = {query_hash(q): q for q in qs}
    if not rows:
        return []
    hashes = sorted(rows)
    part = f"queries-{digest(hashes)}"
    if not bank.has_part("texts", part):
        table = pa.Table.from_pylist([{"text_hash": h, "text": rows[h]} for h in hashes], schema=TEXTS)
        bank.write_part("texts", part, table)
    return hashes


def needed_hashes(bank: Bank, *, include_queries: bool = True) -> list[str]:
    """Every text hash the nodes (all granularities) and the queries need embedded."""
    need: set[str] = set()
    sessions = bank.read("sessions", ["text_hash"])
    need.update(sessions.column("text_hash").to_pylist())
    sess = sorted(need)
    if bank.exists("pairs"):
        pairs = bank.read("pairs", ["text_hash"], filter=pc.field("session_hash").isin(sess))
        need.update(pairs.column("text_hash").to_pylist())
    if bank.exists("nodes"):
        nodes = bank.read("nodes", ["granularity", "text_hash"])
        need.update(nodes.filter(pc.field("granularity") != "turn").column("text_hash").to_pylist())
    elif bank.exists("generations"):
        # no nodes yet: every derived text the generation stage added (summaries, keywords, hybrids)
        for part in bank.parts("texts"):
            if part.startswith("derived-"):
                need.update(bank.read("texts", ["text_hash"], parts=[part]).column("text_hash").to_pylist())
    if include_queries:
        need.update(add_query_texts(bank))
    return sorted(need)


def _existing(bank: Bank, encoder_name: str) -> set[str]:
    if not bank.exists("embeddings"):
        return set()
    t = bank.read("embeddings", ["text_hash", "encoder"], filter=pc.field("encoder") == encoder_name)
    return set(t.column("text_hash").to_pylist())


def _truncation_flags(encoder: Encoder, texts: Sequence[str]) -> list[bool]:
    """Whether each text exceeds the encoder's token limit (exact where the backend can count tokens)."""
    count = getattr(encoder, "count_tokens", None)
    if callable(count):
        try:  # memgas encoders: count_tokens(list[str]) -> array of counts (without special tokens)
            counts = np.asarray(count(list(texts))).reshape(-1)
            if counts.shape[0] == len(texts):
                return [int(c) > encoder.max_tokens - 2 for c in counts]
        except TypeError:
            pass
    # estimate: ~1.3 word pieces per whitespace word for English BERT-style vocabularies
    return [len(t.split()) * 1.3 > encoder.max_tokens for t in texts]


def encode_texts(encoder: Encoder, texts: Sequence[str], *, batch: int = 1024) -> tuple[np.ndarray, list[bool]]:
    """Encode in length-sorted chunks of ``batch`` texts (less padding); vectors and truncation flags
    in input order. Flags come from the encoder's own ``last_truncated`` record when it keeps one."""
    n = len(texts)
    out = np.zeros((n, encoder.dim), np.float32)
    trunc = [False] * n
    order = sorted(range(n), key=lambda i: (len(texts[i]), i))
    for a in range(0, n, batch):
        idx = order[a : a + batch]
        chunk = [texts[i] for i in idx]
        vec = np.asarray(encoder.encode(chunk), dtype=np.float32)
        if vec.shape != (len(idx), encoder.dim):
            raise ValueError(f"encoder {encoder.name} returned shape {vec.shape}, expected ({len(idx)}, {encoder.dim})")
        out[idx] = vec
        flags = getattr(encoder, "last_truncated", None)
        if flags is None or len(flags) != len(idx):
            flags = _truncation_flags(encoder, chunk)
        for i, f in zip(idx, flags):
            trunc[i] = bool(f)
        log.info("encoding: %d/%d texts", min(a + batch, n), n)
    return out, trunc


def run_encoding(
    bank: Bank,
    encoder: Encoder,
    *,
    hashes: Iterable[str] | None = None,
    batch: int = 1024,
    include_queries: bool = True,
    part_rows: int = 200_000,
    ledger: TokenLedger | None = None,
) -> dict[str, Any]:
    """Embed every needed text (``hashes`` or :func:`needed_hashes`) that has no ``encoder.name`` vector."""
    t0 = time.perf_counter()
    need = sorted(set(hashes)) if hashes is not None else needed_hashes(bank, include_queries=include_queries)
    have = _existing(bank, encoder.name)
    todo = [h for h in need if h not in have]
    stats: dict[str, Any] = {"encoder": encoder.name, "needed": len(need), "cached": len(need) - len(todo), "encoded": 0}
    if not todo:
        stats["wall_s"] = round(time.perf_counter() - t0, 3)
        log.info("encoding: all %d texts cached for %s", len(need), encoder.name)
        return stats
    n_trunc = 0
    schema = embeddings_schema(encoder.dim)
    for a in range(0, len(todo), part_rows):
        chunk = todo[a : a + part_rows]
        t = bank.read("texts", ["text_hash", "text"], filter=pc.field("text_hash").isin(chunk))
        texts = dict(zip(t.column("text_hash").to_pylist(), t.column("text").to_pylist()))
        absent = [h for h in chunk if h not in texts]
        if absent:
            from memgas.pipeline.errors import BankError

            raise BankError(f"{bank.path}: {len(absent)} texts to encode are missing from 'texts' (first text_hash {absent[0]})")
        body = [texts[h] for h in chunk]
        vecs, trunc = encode_texts(encoder, body, batch=batch)
        n_trunc += sum(trunc)
        table = pa.Table.from_arrays(
            [
                pa.array(chunk, pa.string()),
                pa.array([encoder.name] * len(chunk), pa.string()),
                pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1), pa.float32()), encoder.dim),
                pa.array(trunc, pa.bool_()),
            ],
            schema=schema,
        )
        bank.write_part("embeddings", f"emb-{slug(encoder.name)}-{digest(chunk)}", table, dim=encoder.dim)
    wall = time.perf_counter() - t0
    stats.update(encoded=len(todo), truncated=n_trunc, dim=encoder.dim, wall_s=round(wall, 3))
    if ledger is not None:
        s = ledger.stage("encoding")
        s.requests += len(todo)
        s.wall_s += wall
        ledger.count("encoding", "truncated", n_trunc)
    if n_trunc:
        log.warning("encoding: %d of %d texts longer than %s's %d tokens (truncated)", n_trunc, len(todo), encoder.name, encoder.max_tokens)
    log.info("encoding: %s", stats)
    return stats
