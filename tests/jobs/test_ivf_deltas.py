"""IVF deltas (jobs/history_index/ivf_store.py, ``IVF_MAX_DELTAS`` / ``IVF_DELTA_SHARE``): an append saves the entries
it added to a history's index as a small index of their own beside the full index it started from. Merged in
order, they give a fresh build's index byte for byte; the edges are the same; a damaged delta is never
merged (the index is continued from before it); past the limits a full index is saved again and the
superseded parts are dropped. Seeded 32-d banks (``test_node_blocks``), the IVF of its cut tests."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from memgas.jobs import tables
from memgas.jobs.history_index import ivf_store
from memgas.jobs.stages import associate
from memgas.pipeline.association.segments import Coverage
from memgas.pipeline.association import ivf_search
from memgas.pipeline.bank import Bank

from .test_node_blocks import (
    GRID,
    IVF_SMALL,
    associate_ctx,
    associate_rows,
    copy_parts,
    damage_part,
    run_associate,
    seeded_bank,
)


def merged_index(bank: Bank, history: str) -> tuple[bytes, int, list[tuple[int, int]]]:
    """The history's index as a search would load it: its full index (after a run only current parts are
    left) with its deltas merged in order; and the full index's sessions and the deltas' (base, sessions)."""
    full = bank.read("ivf_index")
    rows = [r for r in full.to_pylist() if r["history_id"] == history]
    assert len({r["sessions"] for r in rows}) == 1, "more than one full index kept"
    sessions, dim = rows[0]["sessions"], rows[0]["dim"]
    blob = b"".join(r["index"] for r in rows)
    index = ivf_search.index_from_bytes(blob, ivf_search.IVFParams(), d=dim, ntotal=4 * sessions)
    chain = []
    if bank.parts("ivf_delta"):
        deltas: dict[int, list[dict]] = {}
        for r in bank.read("ivf_delta").to_pylist():
            if r["history_id"] == history:
                deltas.setdefault(r["base_sessions"], []).append(r)
        at = sessions
        while at in deltas:
            d = deltas.pop(at)
            end = d[0]["sessions"]
            index.merge_delta(ivf_search.raw_from_bytes(b"".join(r["index"] for r in d), d=dim,
                                                        ntotal=4 * (end - at)))
            chain.append((at, end))
            at = end
        assert not deltas, "a delta kept that continues nothing"
    return ivf_search.index_bytes(index).tobytes(), sessions, chain


@pytest.fixture()
def ivf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ivf_search, "STAGE_BLOCK_SESSIONS", GRID)
    monkeypatch.setattr(ivf_store, "IVF_DELTA_SHARE", 1)  # deltas of up to the full index's own sessions


def _grow(tmp_path: Path, src: Bank, name: str, n: int) -> tuple[Bank, dict]:
    bank, _ = seeded_bank(tmp_path / name, {"h": n})
    copy_parts(src, bank)
    _, stats = run_associate(associate_ctx(bank, IVF_SMALL))
    return bank, stats


def test_appends_save_deltas_that_merge_into_a_fresh_build(tmp_path: Path, ivf: None) -> None:
    """250 sessions (a full index of 240), then appends to 300 and 360: two deltas (240 -> 288 -> 352),
    the full index kept as it was; merged, the index of one build over 360 sessions, and the same edges."""
    fresh, _ = seeded_bank(tmp_path / "fresh", {"h": 360})
    run_associate(associate_ctx(fresh, IVF_SMALL))
    want = associate_rows(fresh)
    want_index, want_sessions, _ = merged_index(fresh, "h")
    assert want_sessions == 352 and not fresh.parts("ivf_delta")

    first, _ = seeded_bank(tmp_path / "first", {"h": 250})
    run_associate(associate_ctx(first, IVF_SMALL))
    mid, stats = _grow(tmp_path, first, "mid", 300)
    assert stats["ivf_index_reused"] == 1 and stats["ivf_index_rebuilt"] == 0
    assert merged_index(mid, "h")[1:] == (240, [(240, 288)])
    grown, stats = _grow(tmp_path, mid, "grown", 360)
    got_index, sessions, chain = merged_index(grown, "h")
    assert (sessions, chain) == (240, [(240, 288), (288, 352)])
    assert got_index == want_index
    assert associate_rows(grown)["edges"] == want["edges"]
    # a delta is a small part: the entries of its sessions and the centroids, not the history's index
    sizes = [len(r["index"]) for r in grown.read("ivf_delta").to_pylist()]
    assert max(sizes) < len(want_index) / 2, sizes


def test_past_the_limit_a_full_index_is_saved_and_the_deltas_dropped(tmp_path: Path, ivf: None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fresh, _ = seeded_bank(tmp_path / "fresh", {"h": 360})
    run_associate(associate_ctx(fresh, IVF_SMALL))
    first, _ = seeded_bank(tmp_path / "first", {"h": 250})
    run_associate(associate_ctx(first, IVF_SMALL))
    mid, _ = _grow(tmp_path, first, "mid", 300)
    monkeypatch.setattr(ivf_store, "IVF_MAX_DELTAS", 1)  # mid's one delta is the most: the next saves whole
    grown, _ = _grow(tmp_path, mid, "grown", 360)
    assert merged_index(grown, "h")[1:] == (352, [])
    assert not grown.parts("ivf_delta"), "the superseded delta was kept"
    assert associate_rows(grown)["ivf_index"] == associate_rows(fresh)["ivf_index"]


def _fresh_and_grown_with_a_delta(tmp_path: Path) -> tuple[Bank, Bank, str]:
    """A fresh build of 360 sessions, and a bank grown 250 -> 300 -> 360 whose index is the full one of 240
    sessions and one delta 240 -> 288 (its part, returned third), before its last association."""
    fresh, _ = seeded_bank(tmp_path / "fresh", {"h": 360})
    run_associate(associate_ctx(fresh, IVF_SMALL))
    first, _ = seeded_bank(tmp_path / "first", {"h": 250})
    run_associate(associate_ctx(first, IVF_SMALL))
    mid, _ = _grow(tmp_path, first, "mid", 300)
    grown, _ = seeded_bank(tmp_path / "grown", {"h": 360})
    copy_parts(mid, grown)
    [part] = grown.parts("ivf_delta")
    return fresh, grown, part


def test_a_damaged_delta_is_never_merged(tmp_path: Path, ivf: None, caplog: pytest.LogCaptureFixture) -> None:
    """The delta 240 -> 288 damaged: the next append continues the index from the full one (240), adds the
    sessions since again from the node blocks, and saves a delta 240 -> 352 over it: a fresh build's index."""
    fresh, grown, part = _fresh_and_grown_with_a_delta(tmp_path)
    damage_part(grown, "ivf_delta", part)
    with caplog.at_level(logging.WARNING):
        _, stats = run_associate(associate_ctx(grown, IVF_SMALL))
    assert "ivf_delta" in caplog.text and "damaged" in caplog.text
    assert stats["ivf_index_rebuilt"] == 1 and stats["ivf_index_reused"] == 1
    got, sessions, chain = merged_index(grown, "h")
    assert (sessions, chain) == (240, [(240, 352)])
    assert got == merged_index(fresh, "h")[0]
    assert associate_rows(grown)["edges"] == associate_rows(fresh)["edges"]


@pytest.mark.parametrize("damage", ["truncated", "FIFO"])
def test_a_delta_that_cannot_be_read_is_never_opened(tmp_path: Path, ivf: None, damage: str) -> None:
    """The delta 240 -> 288 cut short or a FIFO (its read stopped the stage: "unreadable Parquet part;
    delete it and re-run", or waited for ever): passed by unopened; the index continues from the full one
    and saves a delta 240 -> 352 over it, a fresh build's index and edges."""
    fresh, grown, part = _fresh_and_grown_with_a_delta(tmp_path)
    f = grown.path / "ivf_delta" / f"{part}.parquet"
    if damage == "truncated":
        f.write_bytes(f.read_bytes()[:-100])
    else:
        f.unlink()
        os.mkfifo(f)
    _, stats = run_associate(associate_ctx(grown, IVF_SMALL))
    assert (stats["ivf_index_rebuilt"], stats["ivf_index_reused"]) == (0, 1)
    got, sessions, chain = merged_index(grown, "h")
    assert (sessions, chain) == (240, [(240, 352)])
    assert got == merged_index(fresh, "h")[0]
    assert associate_rows(grown)["edges"] == associate_rows(fresh)["edges"]


def test_a_damaged_index_rebuilt_to_as_many_sessions_replaces_it(tmp_path: Path, ivf: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The full index of 240 sessions damaged, then an append that completes no grid block (250 -> 252): the
    task rebuilds an index of the same 240 sessions. The damaged part is not current (never a tie with the
    rebuilt one) and is dropped; the next append reuses the rebuilt index and equals a fresh build."""
    fresh, _ = seeded_bank(tmp_path / "fresh", {"h": 300})
    run_associate(associate_ctx(fresh, IVF_SMALL))
    first, _ = seeded_bank(tmp_path / "first", {"h": 250})
    run_associate(associate_ctx(first, IVF_SMALL))
    mid, _ = seeded_bank(tmp_path / "mid", {"h": 252})
    copy_parts(first, mid)
    [part] = mid.parts("ivf_index")
    damage_part(mid, "ivf_index", part)
    damaged = {rel: (mid.path / "ivf_index" / rel).read_bytes() for rel in (f"{part}.parquet", f"_done/{part}.json")}
    ctx = associate_ctx(mid, IVF_SMALL)
    _, stats = run_associate(ctx)
    assert stats["ivf_index_rebuilt"] == 1 and stats["ivf_index_reused"] == 0
    [rebuilt] = mid.parts("ivf_index")
    assert rebuilt != part
    # both parts side by side (the damaged one put back), listed in either order: the intact one is current
    for rel, data in damaged.items():
        (mid.path / "ivf_index" / rel).write_bytes(data)
    prefix = tables.prefix(associate.AssociateStage, ctx)
    real = associate.current_coverage
    cov = real(ctx, prefix)
    for order in (cov.parts, cov.parts[::-1]):
        monkeypatch.setattr(associate, "current_coverage", lambda *a, c=Coverage(tuple(order), cov.covered): c)
        assert associate.current_indexes(ctx, prefix)["h"][0] == rebuilt
    monkeypatch.setattr(associate, "current_coverage", real)
    mid.drop_part("ivf_index", part)
    assert merged_index(mid, "h")[1:] == (240, [])
    grown, stats = _grow(tmp_path, mid, "grown", 300)
    assert stats["ivf_index_reused"] == 1 and stats["ivf_index_rebuilt"] == 0
    assert merged_index(grown, "h")[0] == merged_index(fresh, "h")[0]
    assert associate_rows(grown)["edges"] == associate_rows(fresh)["edges"]
