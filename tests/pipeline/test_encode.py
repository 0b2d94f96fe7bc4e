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
