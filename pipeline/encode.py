"""Encoding: embed texts with an encoder, in length-sorted batches (less padding), and build the
``embeddings`` rows of one unit. Which texts a run needs, and under which cache key, is the encode stage's
business (``jobs/stages/encode.py``: every node text, turn pair and question, once per encoder key).

Queries are embedded like every other text: a query's vector is looked up by ``text_hash(question)``
(:func:`query_hash`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from memgas.pipeline.hashing import text_hash
from memgas.pipeline.models.base import Encoder
from memgas.pipeline.schema import embeddings_schema

log = logging.getLogger(__name__)


def query_hash(question: str) -> str:
    """Key of a query's vector in ``embeddings`` (the question text's hash)."""
    return text_hash(question)


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


@dataclass
class EncodeResult:
    """What :func:`encode_texts` returns, per text in input order.

    ``tokens``: tokens the model actually ran on (special tokens included; with ``long_text="mean-windows"``
    every window counts), ``tokens_dropped``: tokens cut off by truncation. Both are exact for memgas
    encoders (``last_tokens`` / ``last_tokens_dropped``); for other encoders they come from
    ``count_tokens`` when it exists, else they are ``None`` (unknown, never a guess).
    """

    vectors: np.ndarray  # float32 [n, dim]
    truncated: np.ndarray  # bool [n]
    tokens: np.ndarray | None  # int32 [n]
    tokens_dropped: np.ndarray | None  # int32 [n]

    @property
    def n_truncated(self) -> int:
        return int(self.truncated.sum())

    @property
    def total_tokens(self) -> int:
        return int(self.tokens.sum()) if self.tokens is not None else 0

    @property
    def total_dropped(self) -> int:
        return int(self.tokens_dropped.sum()) if self.tokens_dropped is not None else 0


def _token_counts(encoder: Encoder, texts: Sequence[str], n_ret: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(tokens encoded, tokens dropped) per text: the encoder's own record of its last call, else derived
    from ``count_tokens`` (truncation at ``max_tokens`` with 2 special tokens), else None."""
    tok = getattr(encoder, "last_tokens", None)
    drop = getattr(encoder, "last_tokens_dropped", None)
    if tok is not None and drop is not None and len(tok) == n_ret == len(drop):
        return np.asarray(tok, np.int64), np.asarray(drop, np.int64)
    count = getattr(encoder, "count_tokens", None)
    if callable(count):
        try:
            c = np.asarray(count(list(texts)), np.int64).reshape(-1)
        except TypeError:
            return None
        if c.shape[0] == len(texts):
            window = max(int(encoder.max_tokens) - 2, 1)
            return np.minimum(c, window) + 2, np.maximum(c - window, 0)
    return None


def encode_texts(encoder: Encoder, texts: Sequence[str], *, batch: int = 1024) -> EncodeResult:
    """Encode in length-sorted chunks of ``batch`` texts (less padding); vectors, truncation flags and
    token counts in input order. Flags and counts come from the encoder's own record of each call
    (``last_truncated``, ``last_tokens``, ``last_tokens_dropped``) when it keeps one."""
    n = len(texts)
    out = np.zeros((n, encoder.dim), np.float32)
    trunc = np.zeros(n, bool)
    tokens: np.ndarray | None = np.zeros(n, np.int64)
    dropped: np.ndarray | None = np.zeros(n, np.int64)
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
        trunc[idx] = np.asarray(flags, bool)
        counts = _token_counts(encoder, chunk, len(vec)) if tokens is not None else None
        if counts is None:
            tokens = dropped = None
        else:
            tokens[idx], dropped[idx] = counts
        log.info("encoding: %d/%d texts", min(a + batch, n), n)
    as32 = (lambda x: x.astype(np.int32)) if tokens is not None else (lambda x: None)
    return EncodeResult(out, trunc, as32(tokens), as32(dropped))


def embeddings_table(encoder: Encoder, hashes: Sequence[str], texts: Sequence[str], key: str) -> pa.Table:
    """One ``embeddings`` part: the vectors of ``texts`` under the cache key ``key`` (see jobs/keys.py),
    with truncation and, where :func:`encode_texts` reports them, the tokens encoded and dropped."""
    result = encode_texts(encoder, list(texts))
    if isinstance(result, tuple):  # (vectors, truncated flags)
        vecs, trunc, extra = result[0], result[1], {}
    else:
        vecs, trunc = result.vectors, result.truncated
        extra = {k: getattr(result, k) for k in ("tokens", "tokens_dropped") if getattr(result, k, None) is not None}
    vecs = np.ascontiguousarray(vecs, dtype=np.float32)
    dim = vecs.shape[1]
    schema = embeddings_schema(dim)
    cols: dict[str, Any] = {
        "text_hash": pa.array(list(hashes), pa.string()),
        "encoder": pa.array([key] * len(hashes), pa.string()),
        "vector": pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1), pa.float32()), dim),
        "truncated": pa.array(np.asarray(trunc, dtype=bool)),
    }
    for name in ("tokens", "tokens_dropped"):  # null where the encoder cannot count (never a guess)
        values = extra.get(name)
        cols[name] = (pa.array(np.asarray(values, dtype=np.int32)) if values is not None
                      else pa.nulls(len(hashes), pa.int32()))
    return pa.table({n: cols[n] for n in schema.names if n in cols}).cast(
        pa.schema([schema.field(n) for n in schema.names if n in cols]))


#: Rows of :func:`encoding_accounting`, in report order.
ACCOUNTING_GROUPS = ("session", "turn pair", "summary", "keyword", "hybrid", "question")


def encoding_accounting(bank: Any, key: str, pair_key: str | None = None,
                        session_key: str | None = None,
                        extra: dict[str, set[str]] | None = None) -> dict[str, dict[str, int]]:
    """Per granularity of the bank's index under encoder cache key ``key``: unique texts, texts truncated,
    tokens of each text's model inputs and tokens cut by truncation (the ``embeddings`` columns), plus
    ``all`` over the unique (text, key) vectors. A text in two groups (a one-pair session is also its pair)
    counts in both. A text whose truncated input equals another's is run once by the encoder when both are
    in one call, but counts its own tokens here: the stored columns are a function of the text alone, so
    they do not depend on how texts were cut into units. ``pair_key`` / ``session_key``: the cache key of the turn pairs / sessions when they have their
    own window. ``extra``: more groups of text hashes encoded under ``key`` (JustMem's card texts and plan
    rewrites), counted like the others and in ``all``."""
    import pyarrow.compute as pc

    if not bank.exists("embeddings"):
        return {}

    read: dict[str, dict[str, tuple[bool, int | None, int | None]]] = {}

    def rows(k: str) -> dict[str, tuple[bool, int | None, int | None]]:
        if k not in read:
            emb = bank.read("embeddings", ["text_hash", "truncated", "tokens", "tokens_dropped"],
                            filter=pc.field("encoder") == k)
            read[k] = {h: (bool(t), tok, drop) for h, t, tok, drop in zip(
                emb["text_hash"].to_pylist(), emb["truncated"].to_pylist(), emb["tokens"].to_pylist(),
                emb["tokens_dropped"].to_pylist())}
        return read[k]

    key_of = {g: key for g in ACCOUNTING_GROUPS}
    key_of["turn pair"] = pair_key or key
    key_of["session"] = session_key or key
    groups: dict[str, set[str]] = {g: set() for g in ACCOUNTING_GROUPS}
    if bank.exists("sessions"):
        groups["session"] = set(bank.read("sessions", ["text_hash"])["text_hash"].to_pylist())
    if bank.exists("pairs"):
        groups["turn pair"] = set(bank.read("pairs", ["text_hash"])["text_hash"].to_pylist())
    if bank.exists("nodes"):
        nodes = bank.read("nodes", ["granularity", "text_hash"])
        for g in ("summary", "keyword", "hybrid"):
            groups[g] = set(nodes.filter(pc.field("granularity") == g)["text_hash"].to_pylist())
    if bank.exists("queries"):
        groups["question"] = {query_hash(q) for q in bank.read("queries", ["question"])["question"].to_pylist()}
    for g, hs in (extra or {}).items():
        groups[g] = set(hs)
        key_of[g] = key
    # "all": every (text, key) vector the index holds once
    every = {(h, key_of[g]) for g, hs in groups.items() for h in hs}
    out: dict[str, dict[str, int]] = {}
    for g, got in [*((g, [rows(key_of[g]).get(h) for h in hs]) for g, hs in groups.items()),
                   ("all", [rows(k).get(h) for h, k in every])]:
        got = [r for r in got if r is not None]
        if not got:
            continue
        known = [r for r in got if r[1] is not None]
        out[g] = {"texts": len(got), "truncated": sum(r[0] for r in got),
                  "tokens": sum(r[1] for r in known) if len(known) == len(got) else None,
                  "tokens_dropped": sum(r[2] or 0 for r in known) if len(known) == len(got) else None}
    return out
