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
         "evidence_session_ids": ["h1-a"], "evidence_turn_ids": None, "evidence_utterance_ids": None,
         "is_abstention": False}]))


@pytest.mark.slow
def test_nodes_and_matrices_through_the_stages(tmp_path, encoder, make_bank, run_stage) -> None:
    from memgas.jobs.keys import encoder_key, generation_key

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
    from memgas.jobs.stages.rank import query_vectors

    assert query_vectors(bank, ["What is my cat's name? 🐱"], key).shape == (1, encoder.dim)
    again, _ = run_stage(bank, cfg, "encode")
    assert again["status"] == "skipped"


def test_matrices_read_sessions_pairs_and_the_rest_from_their_own_keys(tmp_path, make_bank) -> None:
    """With session and pair windows, each role's vectors come from its key, also for a one-pair session
    whose text is its pair's (one hash, two vectors: the session under the session key, the pair under the
    pair key)."""
    import pyarrow as pa

    from memgas.pipeline.hashing import text_hash
    from memgas.pipeline.schema import NODES, embeddings_schema

    bank = make_bank(tmp_path)
    sessions = bank.read("sessions").to_pylist()
    pairs = bank.read("pairs").to_pylist()
    rows, derived = [], {}
    for s in sessions:
        for g in ("session", "turn", "summary", "keyword", "hybrid"):
            h = s["text_hash"] if g in ("session", "turn") else text_hash(f"{g} {s['text_hash']}")
            derived.setdefault(g, set()).add(h)
            rows.append({"history_id": s["history_id"], "session_id": s["session_id"], "position": s["position"],
                         "granularity": g, "text_hash": h})
    bank.write("nodes", pa.Table.from_pylist(rows, schema=NODES))
    level = {"main": 1.0, "sess": 2.0, "pair": 3.0}  # each key's vectors are constant: the source is visible
    emb = []
    for key, hashes in (("main", derived["summary"] | derived["keyword"] | derived["hybrid"]),
                        ("sess", derived["session"]), ("pair", {p["text_hash"] for p in pairs})):
        emb += [{"text_hash": h, "encoder": key, "vector": [level[key]] * 4, "truncated": False, "tokens": 1,
                 "tokens_dropped": 0} for h in sorted(hashes)]
    bank.write("embeddings", pa.Table.from_pylist(emb, schema=embeddings_schema(4)), dim=4)
    one_pair = [s for s in {p["session_hash"] for p in pairs}
                if [p["text_hash"] for p in pairs if p["session_hash"] == s] == [s]]
    assert one_pair  # the fixture has a session whose only pair is its whole text

    m = MatrixLoader(bank, "main", pair_encoder="pair", session_encoder="sess").get("h2")
    assert (m["session"] == 2.0).all() and (m["turn"] == 3.0).all()
    assert all((m[g] == 1.0).all() for g in ("summary", "keyword", "hybrid"))
    with pytest.raises(BankError, match="no 'main' embedding"):  # sessions are not read from the main key
        MatrixLoader(bank, "main", pair_encoder="pair")
