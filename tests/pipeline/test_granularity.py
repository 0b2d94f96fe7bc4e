"""Nodes table and per-history matrices (turn node = mean of its pair vectors), shared texts, errors."""

from __future__ import annotations

import numpy as np
import pytest

from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.errors import BankError
from memgas.pipeline.granularity import MatrixLoader, build_nodes


def test_missing_generations_name_the_session(tmp_path, make_bank) -> None:
    bank = make_bank(tmp_path)
    with pytest.raises(BankError, match=r"history h1 session h1-a"):
        build_nodes(bank, generator_model="x", prompt_version="paper-v1")


def _queries(bank) -> None:
    import pyarrow as pa

    bank.write("queries", pa.Table.from_pylist([
        {"query_id": "q1", "history_id": "h1", "question": "What is my cat's name? 🐱", "question_date_raw": None,
         "question_date": None, "answer": "Miso", "question_type": "single", "category": None,
         "evidence_session_ids": ["h1-a"], "evidence_turn_ids": None, "is_abstention": False}]))


@pytest.mark.slow
def test_nodes_and_matrices_through_the_stages(tmp_path, encoder, make_bank, run_stage) -> None:
    from memgas.jobs.stages import encoder_key, generation_key

    bank = make_bank(tmp_path)
    _queries(bank)
    cfg = MemgasConfig(generation={"generator": "llm-free"}, encoder={"device": "cpu"})
    run_stage(bank, cfg, "generate")
    _, ctx = run_stage(bank, cfg, "nodes")
    model, version = generation_key(ctx)
    nodes = bank.read("nodes")
    assert nodes.num_rows == 4 * 5
    assert nodes == build_nodes(bank, generator_model=model, prompt_version=version)
    assert set(nodes.column("granularity").to_pylist()) == {"session", "turn", "summary", "keyword", "hybrid"}
    key = encoder_key(ctx)
    with pytest.raises(BankError, match="embedding"):
        MatrixLoader(bank, key)  # nothing encoded yet: clear error
    entry, _ = run_stage(bank, cfg, "encode")
    # every session, pair, summary/keyword/hybrid text and the question: once each
    assert entry["status"] == "executed"
    loader = MatrixLoader(bank, key)
    m = {h: loader.get(h) for h in ("h1", "h2")}
    assert m["h1"]["session_ids"] == ["h1-a", "h1-b"] and m["h2"]["session_ids"] == ["h2-b", "h2-c"]
    for g in ("session", "turn", "summary", "keyword", "hybrid"):
        assert m["h1"][g].shape == (2, encoder.dim) and m["h1"][g].dtype == np.float32
    # shared session b: identical rows in both histories
    np.testing.assert_array_equal(m["h1"]["session"][1], m["h2"]["session"][0])
    # turn node = mean of the pair embeddings (the stage's encoder = the fixture's MiniLM on CPU)
    pa_ = encoder.encode(["user: I adopted a cat.\nassistant: Nice!", "user: Her name is Miso.\nassistant: Lovely name."])
    np.testing.assert_allclose(m["h1"]["turn"][0], pa_.mean(0), atol=1e-5)
    # a one-pair session: turn = its only pair (= the session text here)
    np.testing.assert_allclose(m["h2"]["turn"][1], m["h2"]["session"][1], atol=1e-5)
    # the question was embedded too, and a re-run encodes nothing
    from memgas.jobs.stages import query_vectors

    assert query_vectors(bank, ["What is my cat's name? 🐱"], key).shape == (1, encoder.dim)
    again, _ = run_stage(bank, cfg, "encode")
    assert again["status"] == "skipped"
