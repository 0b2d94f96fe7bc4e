"""memgas-cards' long histories in stored blocks, and an IVF append searched on the driver.

The card graph's node blocks are stored as MemGAS's (table ``node_blocks``, under the card graph's own stem and
prefix digests: ``jobs/history_index/card_blocks.py``), so an append builds only its own sessions' rows; over
the history's saved index the driver searches the append's rows once and the task rescores what they found
(``jobs/history_index/card_ivf.py``, MemGAS's found path). Two successive appends equal a fresh build byte
for byte (edges, recall rows, the merged index). A stored block of an earlier state of the history (a
session changed, or a card of one) is never used: the edges equal a build from scratch. One history of 10
sessions, then 4 and 4 more; blocks of 32 rows, an exact prefix of 40 nodes and a grid of 4 sessions; through
the CLI in-process as test_card_graph_append."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from memgas.jobs.history_index import card_blocks, ivf_store
from memgas.jobs.history_index.stored_blocks import TABLE, StoredBlocks
from memgas.pipeline.association import blocks, ivf_search
from memgas.pipeline.bank import Bank

from tests.jobs.test_append_index import _file
from tests.jobs.test_card_graph_append import _config, _edges, _segments
from tests.jobs.test_card_graph_ivf_saved import IVF, _recall, merged_index

GRID, BLOCK = 4, 32


@pytest.fixture()
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny blocks (8 sessions of MemGAS nodes: the history is long), the IVF grid of the saved-index tests and
    deltas of up to the full index's own sessions (so that each append saves one, on the driver)."""
    monkeypatch.setattr(ivf_search, "STAGE_BLOCK_SESSIONS", GRID)
    monkeypatch.setattr(ivf_store, "IVF_DELTA_SHARE", 1)
    monkeypatch.setattr(blocks, "BLOCK_ROWS", BLOCK)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cards_found")
    return {"a": _file(d / "a.jsonl", {0: range(0, 10)}, {0: [3, 8]}),
            "b": _file(d / "b.jsonl", {0: range(10, 14)}, {0: [12]}),
            "c": _file(d / "c.jsonl", {0: range(14, 18)}, {0: [16]})}


def _index(bank: Path, cli: Callable, *extra: str) -> str:
    return cli("index", str(bank), *_config(), *extra).stderr


def _build(bank: Path, cli: Callable, parts: list[Path], *extra: str) -> str:
    """Ingest ``parts`` (the first fresh, the others appended) and index once."""
    for i, f in enumerate(parts):
        cli("ingest", str(f), "--format", "jsonl", *(["--append"] if i else []), "--out", str(bank))
    return _index(bank, cli, *extra)


def _card_parts(bank: Path, seen: dict[str, list]) -> set[str]:
    """The stored blocks of the card graph: the parts under the stems its blocks were stored with."""
    return {p for p in Bank(bank).parts(TABLE) if any(p.startswith(stem) for stem in seen["stems"])}


@pytest.fixture()
def spied(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list]]:
    """The sessions whose card-graph rows were built, the stored parts read (by name) and what the driver's
    search gave (None: the task walked)."""
    from memgas.jobs.stages import card_graph_associate as stage

    seen: dict[str, list] = {"built": [], "loaded": [], "found": [], "stems": []}
    rows, load, found = card_blocks.CardGraphBlocks._session_rows, StoredBlocks._load, stage.card_found
    made = card_blocks.CardGraphBlocks._stored_blocks

    def spy_made(self, *a):  # noqa: ANN001, ANN002, ANN202
        stored = made(self, *a)
        seen["stems"].append(stored.stem)
        return stored

    def spy_rows(self, s0, s1):  # noqa: ANN001, ANN202
        seen["built"].append((s0, s1))
        return rows(self, s0, s1)

    def spy_load(self, part, n):  # noqa: ANN001, ANN202
        m = load(self, part, n)
        if m is not None:
            seen["loaded"].append(part)
        return m

    def spy_found(*a):  # noqa: ANN002, ANN202
        f = found(*a)
        seen["found"].append(f is not None)
        return f

    monkeypatch.setattr(card_blocks.CardGraphBlocks, "_session_rows", spy_rows)
    monkeypatch.setattr(card_blocks.CardGraphBlocks, "_stored_blocks", spy_made)
    monkeypatch.setattr(StoredBlocks, "_load", spy_load)
    monkeypatch.setattr(stage, "card_found", spy_found)
    yield seen


def test_two_appends_build_only_their_rows_search_on_the_driver_and_equal_a_fresh_build(
        tmp_path: Path, cli: Callable, files: dict[str, Path], small: None, spied: dict[str, list]) -> None:
    fresh = {k: tmp_path / f"fresh_{k}" for k in "bc"}
    _build(fresh["b"], cli, [files["a"], files["b"]], *IVF)
    _build(fresh["c"], cli, [files["a"], files["b"], files["c"]], *IVF)
    grown = tmp_path / "grown"
    spied["found"].clear()
    _build(grown, cli, [files["a"]], *IVF)
    assert spied["found"] == [False], "no saved index yet: the task walks"
    stored = _card_parts(grown, spied)
    assert stored and any("-p000000010-" in p for p in stored), "the blocks, the last as far as it goes"
    for step, (f, lo) in enumerate(((files["b"], 10), (files["c"], 14))):
        for k in ("built", "loaded", "found"):
            spied[k].clear()
        cli("ingest", str(f), "--format", "jsonl", "--append", "--out", str(grown))
        log = _index(grown, cli, *IVF)
        want = fresh["bc"[step]]
        assert spied["found"] == [True], "the driver searched the saved index"
        assert "card-graph-associate: history h0:" in log and "shipped (those found)" in log, log
        # only the appended sessions' rows were built: the blocks before them, and the first rows of the last
        # one, were read as stored
        assert spied["built"] and all(s0 >= lo for s0, _ in spied["built"]), spied["built"]
        assert any("-p0000000" in p for p in spied["loaded"]), spied["loaded"]
        assert _segments(grown)[-1] == ("h0", lo, lo + 4)
        assert _edges(grown) == _edges(want) and _edges(grown)
        assert _recall(grown) == _recall(want) and _recall(grown)
        got_index, sessions, chain = merged_index(grown)
        assert (sessions, [c[0] for c in chain]) == (8, [8, 12][: step + 1])
        assert got_index == merged_index(want)[0]
    assert _card_parts(grown, spied) == _card_parts(fresh["c"], spied), "the same blocks, stored under the same names"


def _changed_session(src: Path, dst: Path, session: int) -> Path:
    """``src``'s history with one session's first turn changed (its nodes, and so its cards, change)."""
    record = json.loads(src.read_text())
    record["sessions"][session]["turns"][0]["content"] += " Later we walked to the old lighthouse by the harbour."
    dst.write_text(json.dumps(record) + "\n")
    return dst


def _extra_card(monkeypatch: pytest.MonkeyPatch, marker: str) -> None:
    """The LLM-free extractor gives the session whose turns hold ``marker`` one more card (its text unchanged)."""
    from memgas.pipeline.justmem import extract
    from memgas.pipeline.justmem.text import Card

    plain = extract.extract_llm_free

    def more(turns, **kw):  # noqa: ANN001, ANN003, ANN202
        cards = plain(turns, **kw)
        if any(marker in t.content for t in turns):
            cards = [*cards, Card("I keep a spare key under the blue flower pot.", "fact", None, 0, 0)]
        return cards

    monkeypatch.setattr(extract, "extract_llm_free", more)


@pytest.mark.parametrize("change", ["session", "card"])
def test_a_stored_block_of_an_earlier_history_is_never_used(tmp_path: Path, cli: Callable, files: dict[str, Path],
                                                           small: None, spied: dict[str, list],
                                                           monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    """A bank holding the card-graph blocks of the history as it was, then session 3 (or one of its cards)
    changed: the blocks whose sessions reach session 3 have other prefix digests now and are built again, the
    edges are those of a build from scratch; a block of the sessions before it is still that block."""
    old = tmp_path / "old"
    _build(old, cli, [files["a"]])
    stale = _card_parts(old, spied)
    if change == "session":
        now = _changed_session(files["a"], tmp_path / "a2.jsonl", 3)
    else:
        now = files["a"]
        _extra_card(monkeypatch, "(0.3.0)")
    scratch = tmp_path / "scratch"
    _build(scratch, cli, [now])
    valid = _card_parts(scratch, spied)
    changed = tmp_path / "changed"
    cli("ingest", str(now), "--format", "jsonl", "--out", str(changed))
    for part in Bank(old).parts(TABLE):  # every stored block of the old history, MemGAS's and the card graph's
        t = Bank(old).read(TABLE, parts=[part])
        Bank(changed).write_part(TABLE, part, t, dim=t.schema.field("vector").type.byte_width // 4)
    for k in ("built", "loaded", "found"):
        spied[k].clear()
    _index(changed, cli)
    assert _edges(changed) == _edges(scratch) and _edges(changed)
    assert _segments(changed) == _segments(scratch)
    used = set(spied["loaded"]) & stale
    assert not used - valid, f"stale blocks read: {sorted(used - valid)}"
    assert stale - valid and spied["built"], "the change made stored blocks stale: their rows were built again"
    for part in valid & stale:  # a block before the change, reused: its rows are those built from scratch
        a, b = (Bank(x).read(TABLE, parts=[part])["vector"] for x in (changed, scratch))
        assert np.array_equal(np.frombuffer(b"".join(a.to_pylist()), np.uint8),
                              np.frombuffer(b"".join(b.to_pylist()), np.uint8))


def test_a_damaged_stored_block_is_built_again(tmp_path: Path, cli: Callable, files: dict[str, Path], small: None,
                                               spied: dict[str, list]) -> None:
    """A stored card-graph block whose bytes are not those written is never read: the driver's search gives
    up (its name said the block was there), the unit gets every block, the damaged one built again (logged),
    and the edges, recall rows and index equal a fresh build's."""
    from tests.jobs.test_node_blocks import damage_part

    fresh = tmp_path / "fresh"
    _build(fresh, cli, [files["a"], files["b"]], *IVF)
    grown = tmp_path / "grown"
    _build(grown, cli, [files["a"]], *IVF)
    first = sorted(p for p in _card_parts(grown, spied) if "-p" not in p)[0]
    damage_part(Bank(grown), TABLE, first)
    cli("ingest", str(files["b"]), "--format", "jsonl", "--append", "--out", str(grown))
    log = _index(grown, cli, *IVF)
    assert f"stored node block {TABLE}/{first} is damaged" in log, log
    assert "its unit gets every block" in log, log  # found so by the driver's exact search of the sample
    assert Bank(grown).verify_part(TABLE, first), "built again and stored"
    assert _edges(grown) == _edges(fresh)
    assert _recall(grown) == _recall(fresh)
    assert merged_index(grown)[0] == merged_index(fresh)[0]
