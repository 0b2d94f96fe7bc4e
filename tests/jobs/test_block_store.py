"""Stored node blocks (jobs/history_index/stored_blocks.py): a long history's complete blocks are kept in the bank
and read instead of gathered; the bits are the gathered ones; a damaged or stale part is never read.

Banks of seeded node vectors (``test_node_blocks.seeded_bank``), blocks of 8 rows (2 sessions)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from memgas.jobs.history_index import stored_blocks as block_store
from memgas.jobs.history_index.prefixes import chains
from memgas.jobs.stages.associate import AssociateStage
from memgas.jobs.history_index import HistoryBlocks
from memgas.pipeline.association import blocks
from memgas.pipeline.bank import Bank

from .test_node_blocks import _ipc, _params, _unblocked, damage_part, seeded_bank

ROWS = 8  # 2 sessions a block


def _blocks(ctx, n_rows: int) -> tuple[list[bytes], HistoryBlocks]:
    hb = HistoryBlocks(ctx, "h", ROWS, use_ray=False)
    nb = hb.nodes(n_rows)
    return [np.asarray(nb._block(i)[: min(ROWS, n_rows - i * ROWS)]).tobytes() for i in range(len(nb.blocks))], hb


def _stored(bank: Bank) -> list[str]:
    return bank.parts(block_store.TABLE) if bank.exists(block_store.TABLE) else []


def test_stored_blocks_are_the_gathered_bits_and_only_complete_ones(tmp_path: Path) -> None:
    """A history of 11 sessions: 5 complete blocks are stored on the first read (the 6th, partial, is not),
    and a second read takes those 5 from the bank, gathering only the last block's sessions: same bytes."""
    bank, ctx = seeded_bank(tmp_path / "b", {"h": 11, "g": 3})
    first, hb1 = _blocks(ctx, 44)
    assert hb1.stored.stats() == {"read": 0, "written": 5, "damaged": 0}
    assert len(_stored(bank)) == 5
    second, hb2 = _blocks(ctx, 44)
    assert hb2.stored.stats() == {"read": 5, "written": 0, "damaged": 0}
    assert hb2.reader is not None and hb2.reader.first == 10  # only session 10 gathered
    assert second == first
    # against the whole matrix the stage shipped before blocks
    whole = _unblocked(ctx, {"segments": [["h", 0, 11, "d"]]})["matrices"][0]
    assert b"".join(first) == np.ascontiguousarray(whole).tobytes()


def test_an_append_reads_the_stored_blocks_and_its_edges_equal_a_fresh_build(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks stored for 9 sessions serve an append to 13 (the same first 9 sessions: seeded vectors
    of the same history id and seed): its unit reads 4 stored blocks, gathers from session 8 on, and its
    tables equal those of the whole matrix byte for byte."""
    monkeypatch.setattr(blocks, "BLOCK_ROWS", ROWS)
    short, sctx = seeded_bank(tmp_path / "short", {"h": 9})
    _blocks(sctx, 36)
    long, lctx = seeded_bank(tmp_path / "long", {"h": 13})
    for part in _stored(short):  # the short bank's stored blocks, as an append would find them
        (long.path / block_store.TABLE / "_done").mkdir(parents=True, exist_ok=True)
        for rel in (f"{part}.parquet", f"_done/{part}.json"):
            (long.path / block_store.TABLE / rel).write_bytes((short.path / block_store.TABLE / rel).read_bytes())
    assert len(_stored(long)) == 4
    unit = {"segments": [["h", 9, 13, "d13"]]}
    payload = AssociateStage().inputs(lctx, unit)
    hb = lctx.scratch["node_blocks"]["h"]
    assert hb.stored.stats()["read"] == 4 and hb.reader.first == 8
    got = AssociateStage.run(None, payload, _params(lctx))
    want = AssociateStage.run(None, _unblocked(lctx, unit), _params(lctx))
    assert got["edges"].num_rows > 0
    assert {k: _ipc(t) for k, t in got.items()} == {k: _ipc(t) for k, t in want.items()}
    assert len(_stored(long)) == 6  # blocks 4 and 5 (sessions 8-11) stored; session 12's block is partial


def test_a_damaged_block_is_gathered_again_and_rewritten(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bank, ctx = seeded_bank(tmp_path / "b", {"h": 6})
    first, _ = _blocks(ctx, 24)
    part = sorted(_stored(bank))[1]
    damage_part(bank, block_store.TABLE, part)
    with caplog.at_level(logging.WARNING):
        again, hb = _blocks(ctx, 24)
    assert "damaged" in caplog.text
    assert hb.stored.stats() == {"read": 2, "written": 1, "damaged": 1}
    assert again == first
    assert bank.verify_part(block_store.TABLE, part)  # written again, whole


def test_a_changed_prefix_is_not_read_and_its_old_block_is_dropped(tmp_path: Path) -> None:
    """The same history id with other vectors (another seed: other texts would do the same through the
    digest of its prefix) names other parts: none of the old ones is read, and each is dropped when its
    block is written again."""
    bank, ctx = seeded_bank(tmp_path / "b", {"h": 6})
    _blocks(ctx, 24)
    old = set(_stored(bank))
    chain = chains(ctx)["h"]
    chain_other = [d[::-1] for d in chain]  # stands for another prefix of the same history
    sb = block_store.StoredBlocks(bank, {"k": "v"}, "h", ROWS, chain)
    other = block_store.StoredBlocks(bank, {"k": "v"}, "h", ROWS, chain_other)
    m = np.arange(ROWS * 4, dtype=np.float32).reshape(ROWS, 4)
    sb.put(0, m)
    assert sb.get(0).tobytes() == m.tobytes() and other.get(0) is None
    other.put(0, m + 1)
    assert not bank.has_part(block_store.TABLE, sb.part(0)) and other.get(0).tobytes() == (m + 1).tobytes()
    assert old <= set(_stored(bank))  # another encoder's stem: the job's blocks are untouched


def test_a_failed_write_leaves_the_run_going(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """A full disk (or a read-only bank) while a block is stored: logged, and the blocks are the gathered ones."""
    import errno

    bank, ctx = seeded_bank(tmp_path / "b", {"h": 6})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    want, _ = _blocks(ctx, 24)
    bank.drop(block_store.TABLE)
    monkeypatch.setattr(Bank, "write_part", full)
    with caplog.at_level(logging.WARNING):
        got, hb = _blocks(ctx, 24)
    assert "could not store node block" in caplog.text and "No space left" in caplog.text
    assert got == want and hb.stored.stats()["written"] == 0 and _stored(bank) == []
