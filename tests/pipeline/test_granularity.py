"""Nodes table and per-history matrices (turn node = mean of its pair vectors), shared texts, errors."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.errors import BankError
from memgas.pipeline.granularity import MatrixLoader, build_nodes


def test_missing_generations_name_the_session(tmp_path, make_bank) -> None:
    bank = make_bank(tmp_path)
    with pytest.raises(BankError, match=r"history h1 session h1-a"):
        build_nodes(bank, generator_model="x", prompt_version="paper-v1")


def _build_nodes_oracle(bank, model: str, version: str, history_ids=None):
    """build_nodes as first written: a Python loop per node row (the error's wording aside)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from memgas.pipeline.generate import hybrid_text
    from memgas.pipeline.hashing import text_hash
    from memgas.pipeline.schema import NODE_GRANULARITIES, NODES

    sessions = bank.read("sessions", ["history_id", "session_id", "position", "text_hash"])
    if history_ids is not None:
        sessions = sessions.filter(pc.field("history_id").isin(list(history_ids)))
    sessions = sessions.sort_by([("history_id", "ascending"), ("position", "ascending")])
    gen = bank.read("generations", ["text_hash", "kind", "output", "error"],
                    filter=(pc.field("model") == model) & (pc.field("prompt_version") == version))
    out: dict = {}
    for h, k, o in zip(*(gen[c].to_pylist() for c in ("text_hash", "kind", "output"))):
        out.setdefault(h, {})[k] = o or ""
    texts = dict(zip(*(bank.read("texts", ["text_hash", "text"])[c].to_pylist() for c in ("text_hash", "text"))))
    rows: dict = {n: [] for n in NODES.names}
    for hid, sid, p, h in zip(*(sessions[c].to_pylist() for c in ("history_id", "session_id", "position", "text_hash"))):
        s, kw = out[h]["summary"], out[h]["keywords"]
        node = {"session": h, "turn": h, "summary": text_hash(s), "keyword": text_hash(kw),
                "hybrid": text_hash(hybrid_text(s, kw, texts.get(h, "")))}
        for g in NODE_GRANULARITIES:
            for c, v in zip(NODES.names, (hid, sid, p, g, node[g])):
                rows[c].append(v)
    return pa.Table.from_pydict(rows, schema=NODES)


def _generations(bank, rows: list[tuple[str, str, str | None, str | None]]) -> None:
    import pyarrow as pa

    from memgas.pipeline.schema import schema_for

    bank.write_part("generations", f"g{len(bank.parts('generations')) if bank.exists('generations') else 0}",
                    pa.Table.from_pylist([{"text_hash": h, "kind": k, "model": "m", "prompt_version": "v",
                                           "output": o or "", "error": e} for h, k, o, e in rows],
                                         schema=schema_for("generations")))


def test_build_nodes_equals_a_loop_per_row(tmp_path, make_bank) -> None:
    """Shared sessions, an empty output with its error, a later part that re-writes a generation (the last
    row wins) and a history filter: the rows of the loop per node row, exactly."""
    from memgas.pipeline.hashing import text_hash

    from .conftest import SESS

    bank = make_bank(tmp_path)
    h = {k: text_hash("\n".join(u)) for k, u in SESS.items()}
    _generations(bank, [(h["a"], "summary", "a cat", None), (h["a"], "keywords", "cat; Miso", None),
                        (h["b"], "summary", "", "timeout"), (h["b"], "keywords", "Lisbon", None),
                        (h["c"], "summary", "one", None), (h["c"], "keywords", "one; two", None)])
    _generations(bank, [(h["c"], "summary", "one, again", None)])
    got = build_nodes(bank, generator_model="m", prompt_version="v")
    assert got.num_rows == 4 * 5 and got.equals(_build_nodes_oracle(bank, "m", "v"))
    assert build_nodes(bank, generator_model="m", prompt_version="v", history_ids=["h2"]).equals(
        _build_nodes_oracle(bank, "m", "v", ["h2"]))


def test_a_missing_generation_is_named_first_in_history_and_position_order(tmp_path, make_bank) -> None:
    from memgas.pipeline.hashing import text_hash

    from .conftest import SESS

    bank = make_bank(tmp_path)
    h = {k: text_hash("\n".join(u)) for k, u in SESS.items()}
    # a: both; b (h1's second, h2's first session): neither; c: no keywords
    _generations(bank, [(h["a"], "summary", "s", None), (h["a"], "keywords", "k", None), (h["c"], "summary", "s", None)])
    with pytest.raises(BankError, match=rf"5 generations missing .* \(first: history h1 session h1-b, text_hash "
                                        rf"{h['b']}, kind summary\)"):
        build_nodes(bank, generator_model="m", prompt_version="v")


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


def test_earlier_rows_give_the_same_nodes_and_are_checked(tmp_path, make_bank, monkeypatch) -> None:
    """build_nodes with earlier rows: the same table as without; the texts read are only those of sessions
    the earlier rows do not cover or whose summary or keywords changed since; a hybrid hash in the earlier
    rows is never taken for a session whose inputs differ (a changed generation), nor where two earlier
    sessions of one text disagree."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from memgas.pipeline import granularity
    from memgas.pipeline.hashing import text_hash

    from .conftest import SESS

    bank = make_bank(tmp_path)
    h = {k: text_hash("\n".join(u)) for k, u in SESS.items()}
    _generations(bank, [(h[k], kind, f"{kind} of {k}", None) for k in "abc" for kind in ("summary", "keywords")])
    first = build_nodes(bank, generator_model="m", prompt_version="v")
    read: list[list[str]] = []
    real = granularity._session_texts
    monkeypatch.setattr(granularity, "_session_texts", lambda b, hs: read.append(sorted(hs)) or real(b, hs))
    assert build_nodes(bank, generator_model="m", prompt_version="v", earlier=first).equals(first)
    assert read == [[]]
    # c's summary regenerated: only c's text is read, and its new hybrid is computed
    _generations(bank, [(h["c"], "summary", "another summary of c", None)])
    read.clear()
    again = build_nodes(bank, generator_model="m", prompt_version="v", earlier=first)
    assert again.equals(_build_nodes_oracle(bank, "m", "v")) and not again.equals(first)
    assert read == [[h["c"]]]
    # earlier rows of a's text that disagree on its hybrid hash (a damaged earlier table): computed again
    hyb = pc.and_(pc.equal(first["granularity"], "hybrid"), pc.equal(first["session_id"], "h1-b"))
    bad = first.set_column(4, "text_hash", pc.if_else(hyb, "0" * 32, first["text_hash"]))
    read.clear()
    assert build_nodes(bank, generator_model="m", prompt_version="v", earlier=bad).equals(again)
    assert read == [sorted([h["b"], h["c"]])]
    # earlier rows in another order than build_nodes writes them: nothing taken, every text read
    read.clear()
    shuffled = first.take(pa.array(list(range(first.num_rows))[::-1]))
    assert build_nodes(bank, generator_model="m", prompt_version="v", earlier=shuffled).equals(again)
    assert read == [sorted(h.values())]


def _outputs_oracle(gen: pa.Table, kind: str, uniq: pa.Array) -> list[str | None]:
    """The dict the nodes were built from before: filled in row order (the last row of a text wins), an
    empty or null output as ""."""
    last: dict[str, str] = {}
    for r in gen.to_pylist():
        if r["kind"] == kind:
            last[r["text_hash"]] = r["output"] or ""
    return [last.get(h) for h in uniq.to_pylist()]


def test_each_texts_output_is_its_last_rows_as_a_dict_in_row_order_kept_it() -> None:
    """Texts with one row, several (another output last, an empty one last, a null one last), none; both
    kinds interleaved: the outputs per text equal the row-order dict's, nulls where a text has no row."""
    from memgas.pipeline.granularity import _outputs_of

    rng = np.random.default_rng(7)
    n = 400
    hashes = [f"{i:032x}" for i in rng.integers(0, 150, n)]
    kinds = rng.choice(["summary", "keywords"], n).tolist()
    outs = [None if x == 0 else "" if x == 1 else f"out {i}" for i, x in enumerate(rng.integers(0, 6, n))]
    gen = pa.table({"text_hash": hashes, "kind": kinds, "output": pa.array(outs, pa.string()),
                    "error": pa.nulls(n, pa.string())})
    uniq = pa.array(sorted({f"{i:032x}" for i in range(170)}), pa.string())
    for kind in ("summary", "keywords"):
        got = _outputs_of(gen, kind, uniq).to_pylist()
        want = _outputs_oracle(gen, kind, uniq)
        assert got == want
        assert None in got and "" in got and any(g and g.startswith("out") for g in got)
    empty = gen.slice(0, 0)
    assert _outputs_of(empty, "summary", uniq).to_pylist() == [None] * len(uniq)
