"""Nodes table and per-history matrices (turn node = mean of its pair vectors), shared texts, errors."""

from __future__ import annotations

import numpy as np
import pytest

from memgas.pipeline.config import GenerationConfig
from memgas.pipeline.encode import run_encoding
from memgas.pipeline.errors import BankError
from memgas.pipeline.generate import generation_key, run_generation
from memgas.pipeline.granularity import MatrixLoader, build_nodes, history_matrices


def test_missing_generations_name_the_session(tmp_path, make_bank) -> None:
    bank = make_bank(tmp_path)
    with pytest.raises(BankError, match=r"history h1 session h1-a"):
        build_nodes(bank, generator_model="x", prompt_version="paper-v1")


@pytest.mark.slow
def test_nodes_and_matrices(tmp_path, encoder, make_bank) -> None:
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
