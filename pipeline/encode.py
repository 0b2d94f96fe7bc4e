"""Encoding: embed texts with an encoder, in length-sorted batches (less padding), and build the
``embeddings`` rows of one unit. Which texts a run needs, and under which cache key, is the encode stage's
business (``jobs/stages.py``: every node text, turn pair and question, once per encoder key).

Queries are embedded like every other text: a query's vector is looked up by ``text_hash(question)``
(:func:`query_hash`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
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


def embeddings_table(encoder: Encoder, hashes: Sequence[str], texts: Sequence[str], key: str) -> pa.Table:
    """One ``embeddings`` part: the vectors of ``texts`` under the cache key ``key`` (see jobs/stages.py),
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
    for name, values in extra.items():
        if name in schema.names:
            cols[name] = pa.array(np.asarray(values, dtype=np.int32))
    return pa.table({n: cols[n] for n in schema.names if n in cols}).cast(
        pa.schema([schema.field(n) for n in schema.names if n in cols]))
