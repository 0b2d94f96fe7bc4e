"""memgas-cards' saved IVF index (tables ``card_graph_ivf_index`` and ``card_graph_ivf_delta``, written by
card-graph-associate under ``association.search=ivf``): an append's unit starts from the history's saved index
and walks only the grid blocks from its end (it neither trains nor revisits a block before it), saves what it
added as a delta, and the result equals a fresh build byte for byte (edges, recall rows, the merged index); a
damaged saved index is never used: rebuilt, logged, still equal. One history of 10 sessions, then 4 more, an
exact prefix of 40 nodes and a grid of 4 sessions; through the CLI in-process as test_card_graph_append."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from memgas.jobs.history_index import ivf_store
from memgas.pipeline.association import ivf_search
from memgas.pipeline.bank import Bank
from tests.jobs.test_append_index import _file
from tests.jobs.test_card_graph_append import _config, _edges, _rows, _segments
from tests.jobs.test_node_blocks import damage_part

GRID = 4
IVF = ["--set", "association.search=ivf", "--set", "association.ivf_exact_nodes=40",
       "--set", "association.ivf_nlist=1", "--set", "association.ivf_nprobe=1"]


def _index(bank: Path, cli: Callable) -> str:
    """``memgas index`` under the IVF search; its stderr (the log)."""
    return cli("index", str(bank), *_config(), *IVF).stderr


def _recall(bank: Path) -> list[tuple]:
    """The recall rows, whichever segment holds them (a history's sample does not depend on the cut)."""
    return _rows(bank, "card_graph_ivf_recall", ("history_id", "row", "key", "hits", "total"))


def merged_index(bank: Path, history: str = "h0") -> tuple[bytes, int, list[tuple[int, int]]]:
    """The history's saved index as a unit loads it: its full index with its deltas merged in order (faiss's
    own merge, the stage's code not used); the full index's sessions and the deltas' (base, sessions)."""
    import faiss

    b = Bank(bank)
    rows = [r for r in b.read("card_graph_ivf_index").to_pylist() if r["history_id"] == history]
    assert len({r["sessions"] for r in rows}) == 1, "more than one full index kept"

    owners = []  # the deserialised indexes: their downcast views do not own them

    def load(parts: list[dict]) -> object:
        owners.append(faiss.deserialize_index(np.frombuffer(b"".join(r["index"] for r in parts), np.uint8)))
        return faiss.downcast_index(owners[-1])

    index, at, chain = load(rows), rows[0]["sessions"], []
    deltas: dict[int, list[dict]] = {}
    if b.parts("card_graph_ivf_delta"):
        for r in b.read("card_graph_ivf_delta").to_pylist():
            if r["history_id"] == history:
                deltas.setdefault(r["base_sessions"], []).append(r)
    while at in deltas:
        d = deltas.pop(at)
        index.merge_from(load(d), 0)
        chain.append((at, d[0]["sessions"]))
        at = d[0]["sessions"]
    assert not deltas, "a delta kept that continues nothing"
    return faiss.serialize_index(index).tobytes(), rows[0]["sessions"], chain


@pytest.fixture(scope="module")
def banks(tmp_path_factory: pytest.TempPathFactory, cli: Callable) -> Iterator[dict[str, Path]]:
    """B appends 4 sessions to A's history; ``fresh``: A + B indexed once; ``first``: A indexed (its saved
    index holds sessions [0, 8))."""
    d = tmp_path_factory.mktemp("cards_ivf_saved")
    a = _file(d / "a.jsonl", {0: range(0, 10)}, {0: [3, 8]})
    b = _file(d / "b.jsonl", {0: range(10, 14)}, {0: [12]})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ivf_search, "STAGE_BLOCK_SESSIONS", GRID)
        cli("ingest", str(a), "--format", "jsonl", "--out", str(d / "fresh"))
        cli("ingest", str(b), "--format", "jsonl", "--append", "--out", str(d / "fresh"))
        _index(d / "fresh", cli)
        cli("ingest", str(a), "--format", "jsonl", "--out", str(d / "first"))
        _index(d / "first", cli)
    yield {"b": b, "fresh": d / "fresh", "first": d / "first"}


@pytest.fixture()
def walked(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """The card graph's IVF walks while a test runs: the grid blocks they read (their first node) and their
    trainings (the nodes trained on). MemGAS's own walk (the associate stage) is not counted."""
    from memgas.pipeline import card_graph_ivf

    monkeypatch.setattr(ivf_search, "STAGE_BLOCK_SESSIONS", GRID)
    seen: dict[str, list] = {"blocks": [], "trained": []}
    read, prefix = card_graph_ivf._read_cols, card_graph_ivf._Prefix

    def spy_read(E, c0, c1):  # noqa: ANN001, ANN202
        seen["blocks"].append(c0)
        return read(E, c0, c1)

    def spy_prefix(E, n):  # noqa: ANN001, ANN202
        seen["trained"].append(n)
        return prefix(E, n)

    monkeypatch.setattr(card_graph_ivf, "_read_cols", spy_read)
    monkeypatch.setattr(card_graph_ivf, "_Prefix", spy_prefix)
    return seen


def _append(banks: dict[str, Path], tmp_path: Path, cli: Callable) -> Path:
    grown = tmp_path / "grown"
    shutil.copytree(banks["first"], grown)
    cli("ingest", str(banks["b"]), "--format", "jsonl", "--append", "--out", str(grown))
    return grown


@pytest.mark.parametrize("cut", [False, True])
def test_an_append_walks_from_the_saved_index_and_saves_a_delta_equal_to_a_fresh_build(
        tmp_path: Path, cli: Callable, banks: dict[str, Path], walked: dict[str, list],
        monkeypatch: pytest.MonkeyPatch, cut: bool) -> None:
    """``cut``: the append's rows in two units, [10, 12) and [12, 14), cut at fixed multiples of sessions
    (``CARD_IVF_UNIT_SESSIONS``; the causal work, which cuts the exact search's units, does not cut these):
    each starts from the saved index, the second (the history's last) saves the delta."""
    from memgas.pipeline.association import segments

    monkeypatch.setattr(ivf_store, "IVF_DELTA_SHARE", 1)  # a delta of up to the full index's own sessions
    if cut:
        monkeypatch.setattr(segments, "CARD_IVF_UNIT_SESSIONS", 12)
        monkeypatch.setattr(segments, "UNIT_WORK", 1)  # would cut every session under the exact search
        monkeypatch.setattr(segments, "TILE_SESSIONS", 1)
    want_index, want_sessions, want_chain = merged_index(banks["fresh"])
    assert (want_sessions, want_chain) == (12, [])
    assert merged_index(banks["first"])[1:] == (8, [])
    grown = _append(banks, tmp_path, cli)
    _index(grown, cli)
    # the saved index of sessions [0, 8) loaded, not trained; the blocks [8, 12) and [12, 14) walked, no other
    # (cut: the first unit's prefix ends at 12, its walk at the block [8, 12))
    assert walked["trained"] == [] and len(walked["blocks"]) == (3 if cut else 2), walked
    want_segments = [("h0", 0, 10), ("h0", 10, 12), ("h0", 12, 14)] if cut else [("h0", 0, 10), ("h0", 10, 14)]
    assert _segments(grown) == want_segments
    got_index, sessions, chain = merged_index(grown)
    assert (sessions, chain) == (8, [(8, 12)])
    assert got_index == want_index
    assert _edges(grown) == _edges(banks["fresh"]) and _edges(grown)
    assert _recall(grown) == _recall(banks["fresh"]) and _recall(grown)


def test_a_damaged_saved_index_is_rebuilt_and_equals_a_fresh_build(
        tmp_path: Path, cli: Callable, banks: dict[str, Path], walked: dict[str, list]) -> None:
    grown = _append(banks, tmp_path, cli)
    [part] = Bank(grown).parts("card_graph_ivf_index")
    damage_part(Bank(grown), "card_graph_ivf_index", part)
    log = _index(grown, cli)
    assert f"card_graph_ivf_index/{part}) is damaged" in log, log
    # trained afresh on the exact prefix and walked from session 0: [0, 4) ... [12, 14)
    assert len(walked["trained"]) == 1 and len(walked["blocks"]) == 4 and walked["blocks"][0] == 0, walked
    assert Bank(grown).parts("card_graph_ivf_index") != [part]  # the damaged part is no longer current
    got_index, sessions, chain = merged_index(grown)
    assert (sessions, chain) == (12, [])
    assert got_index == merged_index(banks["fresh"])[0]
    assert _edges(grown) == _edges(banks["fresh"])
    assert _recall(grown) == _recall(banks["fresh"])
