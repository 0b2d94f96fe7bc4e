"""Nodes table and per-history matrices (turn node = mean of its pair vectors), shared texts, errors."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from memgas.pipeline.bank import Bank
from memgas.pipeline.config import GenerationConfig
from memgas.pipeline.encode import run_encoding
from memgas.pipeline.errors import BankError
from memgas.pipeline.generate import generation_key, run_generation
from memgas.pipeline.granularity import MatrixLoader, build_nodes, history_matrices
from memgas.pipeline.hashing import text_hash

SESS = {
    "a": ["user: I adopted a cat.", "assistant: Nice!", "user: Her name is Miso.", "assistant: Lovely name."],
    "b": ["user: Wedding in Lisbon.", "assistant: In June?"],
    "c": ["user: Only one utterance here."],
}


def make_bank(tmp_path) -> Bank:
    """h1 = sessions a, b; h2 = b, c (b shared: stored, generated and embedded once)."""
    bank = Bank.create(tmp_path / "bank")
    texts, pairs, sessions = {}, [], []
    for key, utt in SESS.items():
        st = "\n".join(utt)
        texts[text_hash(st)] = st
        for j in range(0, len(utt), 2):
            pt = "\n".join(utt[j : j + 2])
            texts[text_hash(pt)] = pt
            pairs.append({"session_hash": text_hash(st), "pair_index": j // 2, "text_hash": text_hash(pt),
                          "has_answer": None, "dia_ids": None})
    for hid, keys in (("h1", "ab"), ("h2", "bc")):
        for pos, k in enumerate(keys):
            sessions.append({"history_id": hid, "session_id": f"{hid}-{k}", "position": pos, "date_raw": None,
                             "date": None, "text_hash": text_hash("\n".join(SESS[k])), "n_turns": len(SESS[k]),
                             "dataset_summary": None})
    bank.write("sessions", pa.Table.from_pylist(sessions))
    bank.write("texts", pa.Table.from_pylist([{"text_hash": h, "text": t} for h, t in sorted(texts.items())]))
    bank.write("pairs", pa.Table.from_pylist(pairs))
    return bank


@pytest.fixture(scope="module")
def encoder():
    from memgas.pipeline.models.encoders import SentenceTransformerEncoder

    return SentenceTransformerEncoder("minilm", device="cpu")


def test_missing_generations_name_the_session(tmp_path) -> None:
    bank = make_bank(tmp_path)
    with pytest.raises(BankError, match=r"history h1 session h1-a"):
        build_nodes(bank, generator_model="x", prompt_version="paper-v1")


@pytest.mark.slow
def test_nodes_and_matrices(tmp_path, encoder) -> None:
    bank = make_bank(tmp_path)
    cfg = GenerationConfig(generator="llm-free")
    run_generation(bank, None, encoder, cfg, dataset_kind="longmemeval")
    model, version = generation_key(cfg, None)
    nodes = build_nodes(bank, generator_model=model, prompt_version=version, write=True)
    assert nodes.num_rows == 4 * 5
    assert set(nodes.column("granularity").to_pylist()) == {"session", "turn", "summary", "keyword", "hybrid"}
    with pytest.raises(BankError, match="embedding"):
        history_matrices(bank, "h1", encoder.name)  # nothing encoded yet: clear error
    run_encoding(bank, encoder)
    m = history_matrices(bank, ["h1", "h2"], encoder.name)
    assert m["h1"]["session_ids"] == ["h1-a", "h1-b"] and m["h2"]["session_ids"] == ["h2-b", "h2-c"]
    for g in ("session", "turn", "summary", "keyword", "hybrid"):
        assert m["h1"][g].shape == (2, encoder.dim) and m["h1"][g].dtype == np.float32
    # shared session b: identical rows in both histories
    np.testing.assert_array_equal(m["h1"]["session"][1], m["h2"]["session"][0])
    # turn node = mean of the pair embeddings
    pa_ = encoder.encode(["user: I adopted a cat.\nassistant: Nice!", "user: Her name is Miso.\nassistant: Lovely name."])
    np.testing.assert_allclose(m["h1"]["turn"][0], pa_.mean(0), atol=1e-5)
    # a one-pair session: turn = its only pair (= the session text here)
    np.testing.assert_allclose(m["h2"]["turn"][1], m["h2"]["session"][1], atol=1e-5)
    one = MatrixLoader(bank, encoder.name).get("h2")
    np.testing.assert_array_equal(one["keyword"], m["h2"]["keyword"])
