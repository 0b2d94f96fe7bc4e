"""Encoding stage: every needed text once per encoder; queries included; re-run encodes nothing."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from memgas.pipeline.encode import query_hash, run_encoding


class Counting:
    def __init__(self, enc) -> None:
        self.enc = enc
        self.name, self.dim, self.max_tokens, self.normalize = enc.name, enc.dim, enc.max_tokens, enc.normalize
        self.texts = 0

    @property
    def last_truncated(self):
        return self.enc.last_truncated

    def encode(self, texts):
        self.texts += len(texts)
        return self.enc.encode(texts)


@pytest.mark.slow
def test_encode_once_with_queries_and_truncation(tmp_path, encoder, make_bank) -> None:
    bank = make_bank(tmp_path)
    long_text = "user: " + "tomato " * 2000
    texts = bank.read("texts")
    bank.write_part("texts", "extra", pa.Table.from_pylist([{"text_hash": "longone", "text": long_text}]))
    bank.write("queries", pa.Table.from_pylist([
        {"query_id": "q1", "history_id": "h1", "question": "What is my cat's name? 🐱", "question_date_raw": None,
         "question_date": None, "answer": "Miso", "question_type": "single", "category": None,
         "evidence_session_ids": ["h1-a"], "evidence_turn_ids": None, "is_abstention": False}]))
    enc = Counting(encoder)
    stats = run_encoding(bank, enc)
    n_sessions_and_pairs = texts.num_rows  # 3 sessions + their pairs (one pair text equals a session text)
    assert stats["encoded"] == enc.texts == n_sessions_and_pairs + 1  # + the query
    emb = bank.read("embeddings")
    assert query_hash("What is my cat's name? 🐱") in emb.column("text_hash").to_pylist()
    before = enc.texts
    again = run_encoding(bank, enc)
    assert enc.texts == before and again["encoded"] == 0
    # explicit hashes: the long text is truncated and counted
    s = run_encoding(bank, enc, hashes=["longone"])
    assert s["truncated"] == 1
    row = bank.read("embeddings", filter=pc.field("text_hash") == "longone")
    assert row.column("truncated").to_pylist() == [True]
    v = np.asarray(row.column("vector").to_pylist(), np.float32)
    assert v.shape == (1, encoder.dim)
