"""encode_texts: vectors in input order, truncation flags and real token counts per text."""

from __future__ import annotations

import numpy as np
import pytest

from memgas.pipeline.encode import EncodeResult, encode_texts

LONG = "The quick brown fox jumps over the lazy dog while the band plays on. " * 60  # ~900 tokens


class _Plain:
    """An encoder that keeps no record of its calls (a third-party backend)."""

    name, dim, max_tokens, normalize = "plain", 3, 16, True

    def encode(self, texts):
        return np.asarray([[len(t), 1.0, 0.0] for t in texts], np.float32)


@pytest.mark.slow
def test_encode_texts_counts_real_tokens(encoder) -> None:
    texts = ["a long one: " + LONG, "short", "", "medium text about a cat named Miso"]
    res = encode_texts(encoder, texts, batch=2)  # two chunks: length-sorted order is scattered back
    assert isinstance(res, EncodeResult)
    assert res.vectors.shape == (4, encoder.dim) and res.vectors.dtype == np.float32
    np.testing.assert_allclose(res.vectors, encoder.encode(texts), atol=1e-6)
    raw = encoder.count_tokens(texts)
    assert res.truncated.tolist() == [True, False, False, False]
    assert res.tokens.dtype == np.int32 and res.tokens_dropped.dtype == np.int32
    assert res.tokens.tolist() == [256] + [int(c) + 2 for c in raw[1:]]
    assert res.tokens_dropped.tolist() == [int(raw[0]) - 254, 0, 0, 0]
    assert res.total_tokens == int(res.tokens.sum()) and res.n_truncated == 1


def test_encode_texts_without_token_record() -> None:
    res = encode_texts(_Plain(), ["bb", "a", "ccc"], batch=2)
    np.testing.assert_array_equal(res.vectors[:, 0], [2, 1, 3])  # input order
    assert res.truncated.tolist() == [False, False, False]
    assert res.tokens is None and res.tokens_dropped is None  # unknown, not guessed
    empty = encode_texts(_Plain(), [])
    assert empty.vectors.shape == (0, 3)


def test_encode_plan_puts_each_session_beside_its_turn_pairs(tmp_path, make_bank) -> None:
    """The encode stage's units hold a session next to its pairs, then its summary, keyword and hybrid texts
    (so the encoder can run texts that truncate to the same tokens once: a session and its first pair, a
    hybrid text and its summary); every text is planned exactly once."""
    import pyarrow as pa

    from memgas.jobs.stages.encode import EncodeStage
    from memgas.pipeline.hashing import text_hash
    from memgas.pipeline.schema import NODES

    bank = make_bank(tmp_path)
    pairs = bank.read("pairs").to_pylist()
    sessions = sorted({p["session_hash"] for p in pairs})
    extra = [text_hash("a question?"), text_hash("an orphan text")]
    todo = sorted({*sessions, *(p["text_hash"] for p in pairs), *extra})
    got = EncodeStage._grouped(todo, bank)  # before the nodes exist: sessions and pairs only
    assert sorted(got) == todo and len(got) == len(todo)

    def derived(sh: str) -> list[str]:
        return [text_hash(f"{g} of {sh}") for g in ("summary", "keyword", "hybrid")]

    rows = [{"history_id": s["history_id"], "session_id": s["session_id"], "position": s["position"],
             "granularity": g, "text_hash": s["text_hash"] if g in ("session", "turn") else derived(s["text_hash"])[i - 2]}
            for s in bank.read("sessions").to_pylist()
            for i, g in enumerate(("session", "turn", "summary", "keyword", "hybrid"))]
    bank.write("nodes", pa.Table.from_pylist(rows, schema=NODES))
    todo = sorted({*todo, *(h for sh in sessions for h in derived(sh))})
    got = EncodeStage._grouped(todo, bank)
    assert sorted(got) == todo and len(got) == len(todo)
    for sh in sessions:
        mine = [p["text_hash"] for p in sorted(pairs, key=lambda p: p["pair_index"]) if p["session_hash"] == sh]
        i = got.index(sh)
        # a one-pair session's text is its pair's text: one hash, listed once
        group = [sh, *[h for h in mine if h != sh], *derived(sh)]
        assert got[i : i + len(group)] == group
    assert got[-2:] == sorted(extra)
    assert EncodeStage._grouped([extra[0]], bank) == [extra[0]]  # texts already encoded are not re-planned


@pytest.mark.slow
def test_encoding_accounting_sums_the_embeddings_rows(tmp_path, make_bank, encoder) -> None:
    """Per-granularity accounting = the encoder's own per-text counts, grouped by where the text is used."""
    from memgas.pipeline.encode import embeddings_table, encoding_accounting

    bank = make_bank(tmp_path)
    texts = {r["text_hash"]: r["text"] for r in bank.read("texts").to_pylist()}
    sessions = sorted(set(bank.read("sessions")["text_hash"].to_pylist()))
    pairs = sorted(set(bank.read("pairs")["text_hash"].to_pylist()))
    hashes = sorted(set(sessions) | set(pairs))
    table = embeddings_table(encoder, hashes, [texts[h] for h in hashes], "k1")
    bank.write("embeddings", table)
    tok = dict(zip(table["text_hash"].to_pylist(), table["tokens"].to_pylist()))
    acc = encoding_accounting(bank, "k1")
    assert acc["session"]["texts"] == len(sessions) and acc["turn pair"]["texts"] == len(pairs)
    assert acc["session"]["tokens"] == sum(tok[h] for h in sessions)
    assert acc["turn pair"]["tokens"] == sum(tok[h] for h in pairs)
    assert acc["all"] == {"texts": len(hashes), "truncated": 0, "tokens": sum(tok.values()), "tokens_dropped": 0}
    assert acc["all"]["tokens"] == int(encoder.last_stats.tokens)  # what the model actually ran on
    assert "summary" not in acc and encoding_accounting(bank, "other-key") == {}
    # an extra group (JustMem's cards) counts its own texts and joins "all" without counting a text twice
    extra = {"card": set(pairs[:2])}
    acc = encoding_accounting(bank, "k1", extra=extra)
    assert acc["card"] == {"texts": 2, "truncated": 0, "tokens": sum(tok[h] for h in pairs[:2]), "tokens_dropped": 0}
    assert acc["all"]["texts"] == len(hashes)
