"""An IVF append over a saved index ships only the rows it needs (jobs/history_index/ivf_units.py ``found``): the
driver searches the index once for the new rows (``ivf_search.ivf_found``), reads the stored blocks and
hands the task the rows found before the index's end (``SparseBlock``) and the blocks after it whole. The
edges, recall rows and index equal a fresh build's byte for byte; a read of a row not shipped raises.
Seeded 32-d banks (``test_node_blocks``), blocks of 16 sessions, the IVF grid of the delta tests."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from memgas.jobs import runner
from memgas.jobs.history_index import ivf_mapped, ivf_store, ivf_units
from memgas.jobs.stages.associate import AssociateStage
from memgas.jobs.history_index.block_reader import HistoryBlockReader
from memgas.jobs.history_index.stored_blocks import TABLE, StoredBlocks
from memgas.pipeline.association import blocks, ivf_search
from memgas.pipeline.association.blocks import NodeBlocks, RowsNotShipped, SparseBlock
from memgas.pipeline.bank import Bank

from .test_ivf_deltas import merged_index
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


@pytest.fixture()
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ivf_search, "STAGE_BLOCK_SESSIONS", GRID)
    monkeypatch.setattr(ivf_store, "IVF_DELTA_SHARE", 1)
    monkeypatch.setattr(blocks, "BLOCK_ROWS", 64)
    # a sample of 2 rows: 250 -> 300 sessions then has no sampled row among its new ones (a sampled row is
    # checked against the exact search, which reads every row: that unit gets the whole matrix)
    monkeypatch.setattr(ivf_search, "RECALL_ROWS", 2)


def _grown(tmp_path: Path, n0: int, n: int, with_blocks: bool = True) -> tuple[Bank, Bank]:
    """``n0`` sessions indexed (their complete node blocks stored), then a bank of ``n`` holding its parts."""
    first, _ = seeded_bank(tmp_path / "first", {"h": n0})
    run_associate(associate_ctx(first, IVF_SMALL))
    grown, _ = seeded_bank(tmp_path / "grown", {"h": n})
    copy_parts(first, grown)
    if with_blocks:
        for part in first.parts(TABLE):
            grown.write_part(TABLE, part, first.read(TABLE, parts=[part]), dim=32)
    return first, grown


def test_an_append_ships_only_the_rows_it_found_and_equals_a_fresh_build(tmp_path: Path, small: None,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The tail (from the block of the index's end) is the last block stored as far as session 250 and the
    50 new sessions, the only ones gathered."""
    fresh, _ = seeded_bank(tmp_path / "fresh", {"h": 300})
    run_associate(associate_ctx(fresh, IVF_SMALL))
    first, grown = _grown(tmp_path, 250, 300)
    assert len(first.parts(TABLE)) == 250 // 16 + 1, "the first build stores its blocks, the last as far as it goes"
    partial, gathered = StoredBlocks.partial, []

    def spy(self: StoredBlocks, i: int) -> tuple[int, np.ndarray] | None:
        got = partial(self, i)
        if got is not None:
            gathered.append(("stored", i, got[0]))
        return got

    monkeypatch.setattr(StoredBlocks, "partial", spy)
    read = HistoryBlockReader.read_sessions
    monkeypatch.setattr(HistoryBlockReader, "read_sessions",
                        lambda self, a, b: gathered.append(("gathered", a, b)) or read(self, a, b))
    _, stats = run_associate(associate_ctx(grown, IVF_SMALL))
    assert stats["ivf_found_units"] == 1 and stats["ivf_index_reused"] == 1
    assert gathered == [("stored", 15, 250), ("gathered", 250, 256), ("gathered", 256, 272), ("gathered", 272, 288),
                        ("gathered", 288, 300)]
    want, got = associate_rows(fresh), associate_rows(grown)
    assert got["edges"] == want["edges"]
    recall = [(r[0], *r[3:]) for r in got["ivf_recall"]]  # (history, row, key, hits, total): not its segment
    assert sorted(recall) == sorted((r[0], *r[3:]) for r in want["ivf_recall"] if r[3] in {x[1] for x in recall})
    assert merged_index(grown, "h")[0] == merged_index(fresh, "h")[0]
    assert len(list(ivf_mapped.folder(grown).glob("*.faiss"))) == 1, "the walk searched a mapped copy"


def test_prune_deletes_the_copies_of_parts_no_longer_there(tmp_path: Path, small: None) -> None:
    """``ivf_mapped.prune`` (the associate stage's end calls it) deletes a copy whose part is no longer in
    ``ivf_index`` (a full index saved again supersedes it) and a temporary file a killed write left, and keeps
    the current part's copy."""
    _, grown = _grown(tmp_path, 250, 300)
    run_associate(associate_ctx(grown, IVF_SMALL))
    copy, = ivf_mapped.folder(grown).glob("*.faiss")
    hist, part_key, digest = copy.stem.split("-")
    stale = copy.with_name(f"{hist}-{'0' * len(part_key)}-{digest}.faiss")
    stale.write_bytes(b"an older part's copy")
    (copy.parent / f".{copy.name}.x1y2.tmp").write_bytes(b"half")
    assert ivf_mapped.prune(grown) == 2
    assert list(ivf_mapped.folder(grown).iterdir()) == [copy]
    for part in grown.parts("ivf_index"):
        grown.drop_part("ivf_index", part)
    assert ivf_mapped.prune(grown) == 1 and not list(ivf_mapped.folder(grown).iterdir())


def test_a_mapped_copy_that_is_damaged_or_cannot_be_written_changes_nothing(
        tmp_path: Path, small: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The driver's walk maps a copy of the saved index (jobs/history_index/ivf_mapped.py). A copy whose bytes
    changed (its size kept) is found by its digest, logged, deleted and written again; a copy that cannot be
    written (a full disk) leaves no file and the index is read from its part. Each time the task gets the same
    payload: the ids found and the delta to save."""
    _, grown = _grown(tmp_path, 250, 300)
    ctx = associate_ctx(grown, IVF_SMALL)
    runner.compute_fingerprints(ctx)
    unit = AssociateStage().plan(ctx)[0]

    def payload() -> tuple[list, bytes]:
        out = AssociateStage().inputs(dataclasses.replace(ctx, scratch={}), unit)
        assert out["found"][0] is not None
        return [(k, v.tobytes()) for k, v in sorted(out["found"][0].items())], out["indexes"][0]["found_delta"].tobytes()

    want = payload()
    copy, = ivf_mapped.folder(grown).glob("*.faiss")
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert payload() == want
    assert "is not the bytes written" in caplog.text
    again, = ivf_mapped.folder(grown).glob("*.faiss")
    assert again.read_bytes() != bytes(data) and again.name == copy.name, "written again, the same bytes"
    part_file = next(grown.path.joinpath("ivf_index").glob("*.parquet"))
    assert again.stat().st_mode & 0o777 == part_file.stat().st_mode & 0o777, "the bank's file mode, not 0600"
    assert payload() == want  # the copy written again is checked (hashed) and used
    again.unlink()
    monkeypatch.setenv("MEMGAS_FAULT", "enospc@ivf:mapped-copy:before-rename")
    with caplog.at_level(logging.WARNING):
        assert payload() == want
    assert "reading it from its part" in caplog.text
    assert list(ivf_mapped.folder(grown).iterdir()) == [], "no copy and no temporary file left"


def test_the_payload_holds_the_rows_found_and_the_tail_only(tmp_path: Path, small: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """What the task gets: before the index's end (240 sessions: block 15) a SparseBlock of the rows found
    (or none), from there the blocks whole; and its result equals the run on every row."""
    _, grown = _grown(tmp_path, 250, 300)
    ctx = associate_ctx(grown, IVF_SMALL)
    runner.compute_fingerprints(ctx)
    unit = AssociateStage().plan(ctx)[0]
    payload = AssociateStage().inputs(dataclasses.replace(ctx, scratch={}), unit)
    nb = payload["matrices"][0]
    assert isinstance(nb, NodeBlocks) and payload["found"][0] is not None
    meta = payload["indexes"][0]
    assert meta["saved"] is None and meta["found_delta"] is not None, "the task gets the delta, not the index"
    before, tail = nb.blocks[:15], nb.blocks[15:]
    assert all(h is None or isinstance(h, SparseBlock) for h in before) and any(before)
    shipped = np.concatenate([h.rows + 64 * i for i, h in enumerate(before) if h is not None])
    assert np.array_equal(shipped, ivf_search.found_before(payload["found"][0], 15 * 64))
    assert shipped.size < 15 * 64  # here nearly all (8 lists, 200 new rows); at 10^6 sessions ~4%
    assert len(tail) == 4 and not any(isinstance(h, SparseBlock) for h in tail)
    with pytest.raises(RowsNotShipped):
        nb[np.arange(0, 15 * 64)]
    with pytest.raises(RowsNotShipped):
        nb[0:64]
    monkeypatch.setattr(ivf_units, "FOUND_TAIL_BLOCKS", -1)  # the path before: every row, the task searches
    full = AssociateStage().inputs(dataclasses.replace(ctx, scratch={}), unit)
    assert full["found"] == [None] and full["indexes"][0]["saved"] is not None
    params = {**AssociateStage().active(ctx).params, "recall_rows": ivf_search.RECALL_ROWS}
    got, want = AssociateStage.run(None, payload, params), AssociateStage.run(None, full, params)
    assert set(got) == {"edges", "edge_segments", "ivf_recall", "ivf_delta"}
    assert set(got) == set(want) and all(got[k].equals(want[k]) for k in want)


def test_without_stored_blocks_or_with_a_full_index_to_save_every_row_is_shipped(tmp_path: Path, small: None,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    fresh, _ = seeded_bank(tmp_path / "fresh", {"h": 300})
    run_associate(associate_ctx(fresh, IVF_SMALL))
    _, grown = _grown(tmp_path / "a", 250, 300, with_blocks=False)  # the first append after an upgrade
    _, stats = run_associate(associate_ctx(grown, IVF_SMALL))
    assert stats["ivf_found_units"] == 0 and associate_rows(grown)["edges"] == associate_rows(fresh)["edges"]
    monkeypatch.setattr(ivf_store, "IVF_MAX_DELTAS", 0)  # a full index to save: the task builds it
    _, grown = _grown(tmp_path / "c", 250, 300)
    _, stats = run_associate(associate_ctx(grown, IVF_SMALL))
    assert stats["ivf_found_units"] == 0 and associate_rows(grown)["edges"] == associate_rows(fresh)["edges"]
    assert associate_rows(grown)["ivf_index"] == associate_rows(fresh)["ivf_index"]


def test_rows_of_the_recall_sample_are_searched_exactly_on_the_driver(tmp_path: Path, small: None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An append whose new rows hold rows of the recall sample still ships only the rows found: the driver
    runs the exact search of those rows on the stored blocks (each read once) and ships its candidates; the
    recall rows and the edges equal a fresh build's, and the task never reads a row not shipped."""
    monkeypatch.setattr(ivf_search, "RECALL_ROWS", 256)  # every row sampled (another key: built afresh)
    fresh, _ = seeded_bank(tmp_path / "fresh", {"h": 300})
    _, fresh_stats = run_associate(associate_ctx(fresh, IVF_SMALL))
    _, grown = _grown(tmp_path / "b", 250, 300)
    reads = []
    get = StoredBlocks.get
    monkeypatch.setattr(StoredBlocks, "get", lambda self, i: reads.append(i) or get(self, i))
    _, stats = run_associate(associate_ctx(grown, IVF_SMALL))
    assert stats["ivf_found_units"] == 1
    first = 240 // 16  # the block of the index's end: the tail, read (and gathered) from there
    assert sorted(i for i in reads if i < first) == list(range(first)), "each stored block read once"
    want, got = associate_rows(fresh), associate_rows(grown)
    assert got["edges"] == want["edges"]
    recall = [(r[0], *r[3:]) for r in got["ivf_recall"]]
    new = [r for r in recall if r[1] >= 4 * 250]
    assert len(new) > 50 and all(r[4] > 0 for r in new)  # rows of the 50 new sessions in the history's sample
    common = {r[3] for r in want["ivf_recall"]} & {x[1] for x in new}
    assert len(common) > 10
    assert sorted(x for x in new if x[1] in common) == sorted((r[0], *r[3:]) for r in want["ivf_recall"]
                                                               if r[3] in common)
    assert (stats["ivf_recall"], stats["ivf_recall_rows"]) == (fresh_stats["ivf_recall"], fresh_stats["ivf_recall_rows"])


def test_a_sparse_block_raises_for_rows_not_shipped() -> None:
    v = np.arange(12, dtype=np.float32).reshape(3, 4)
    s = SparseBlock(np.array([1, 5, 9]), v, 16)
    assert s.shape == (16, 4) and np.array_equal(s[np.array([9, 1])], v[[2, 0]])
    for bad in (np.array([2]), np.array([1, 16]), slice(0, 4)):
        with pytest.raises(RowsNotShipped):
            s[bad]
    with pytest.raises(RowsNotShipped):
        NodeBlocks([None, v], 4, 8, 4)[np.array([0])]


@pytest.mark.slow
def test_under_ray_the_rows_found_reach_the_task_through_the_object_store(tmp_path: Path, small: None) -> None:
    """The driver puts each SparseBlock and tail block once; the task (another process, the bank moved away)
    gets the same tables as the in-process run."""
    import shutil

    import ray

    from memgas.jobs.executor import run_task, stage_fn

    _, grown = _grown(tmp_path, 250, 300)
    ctx = associate_ctx(grown, IVF_SMALL)
    runner.compute_fingerprints(ctx)
    unit = AssociateStage().plan(ctx)[0]
    params = {**AssociateStage().active(ctx).params, "recall_rows": ivf_search.RECALL_ROWS}
    want = AssociateStage.run(None, AssociateStage().inputs(dataclasses.replace(ctx, scratch={}), unit), params)
    ray.init(address="local", num_cpus=1, include_dashboard=False, configure_logging=False)
    try:
        payload = AssociateStage().inputs(dataclasses.replace(ctx, use_ray=True, scratch={}), unit)
        nb = payload["matrices"][0]
        assert all(h is None or isinstance(h, ray.ObjectRef) for h in nb.blocks) and payload["found"][0]
        moved = tmp_path / "moved"
        shutil.move(str(grown.path), str(moved))
        try:
            got = ray.get(ray.remote(run_task).remote(stage_fn(AssociateStage()), payload, params))
        finally:
            shutil.move(str(moved), str(grown.path))
        assert set(got) == set(want) and all(got[k].equals(want[k]) for k in want)
    finally:
        ray.shutdown()


def test_a_damaged_stored_block_sends_the_unit_down_the_old_path(tmp_path: Path, small: None,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A stored block the driver reads for its rows is damaged: never read silently. The unit ships every
    block instead (the damaged one gathered again and rewritten), and the edges are a fresh build's."""
    import logging

    fresh, _ = seeded_bank(tmp_path / "fresh", {"h": 300})
    run_associate(associate_ctx(fresh, IVF_SMALL))
    _, grown = _grown(tmp_path, 250, 300)
    part = sorted(grown.parts(TABLE))[3]
    damage_part(grown, TABLE, part)
    with caplog.at_level(logging.WARNING):
        _, stats = run_associate(associate_ctx(grown, IVF_SMALL))
    assert "damaged" in caplog.text and stats["ivf_found_units"] == 0
    assert associate_rows(grown)["edges"] == associate_rows(fresh)["edges"]
    assert grown.verify_part(TABLE, part), "the damaged block was written again"


def test_a_damaged_stored_block_met_by_the_recall_samples_exact_search_is_gathered_again(
        tmp_path: Path, small: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The driver's exact search of the recall sample reads every stored block before the tail: one found
    damaged there stopped `memgas index` ("not stored intact"). The unit ships every block instead, the
    damaged one gathered again and rewritten, and the edges and recall rows are a fresh build's."""
    import logging

    monkeypatch.setattr(ivf_search, "RECALL_ROWS", 256)  # every row sampled: the driver's exact search runs
    fresh, _ = seeded_bank(tmp_path / "fresh", {"h": 300})
    run_associate(associate_ctx(fresh, IVF_SMALL))
    _, grown = _grown(tmp_path / "b", 250, 300)
    part = sorted(grown.parts(TABLE))[3]
    damage_part(grown, TABLE, part)
    with caplog.at_level(logging.WARNING):
        _, stats = run_associate(associate_ctx(grown, IVF_SMALL))
    assert "damaged" in caplog.text and "its unit gets every block" in caplog.text, caplog.text
    assert stats["ivf_found_units"] == 0
    want, got = associate_rows(fresh), associate_rows(grown)
    assert got["edges"] == want["edges"]
    # the new segment's sampled rows (history, row, ...: the segment's bounds differ by design) as a fresh build's
    new = {(r[0], *r[3:]) for r in got["ivf_recall"] if r[1] == 250}
    fresh_rows = {(r[0], *r[3:]) for r in want["ivf_recall"]}
    common = {x[1] for x in new} & {x[1] for x in fresh_rows}
    assert len(new) > 50 and len(common) > 10
    assert {x for x in new if x[1] in common} == {x for x in fresh_rows if x[1] in common}
    assert grown.verify_part(TABLE, part), "the damaged block was written again"
