"""Stored node blocks (jobs/history_index/stored_blocks.py): a long history's complete blocks, and its last block
as far as it goes, are kept in the bank and read instead of gathered; the bits are the gathered ones; a
damaged or stale part is never read.

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
from memgas.pipeline.errors import BankError

from .test_node_blocks import _ipc, _params, _unblocked, damage_part, seeded_bank

ROWS = 8  # 2 sessions a block


def _blocks(ctx, n_rows: int) -> tuple[list[bytes], HistoryBlocks]:
    hb = HistoryBlocks(ctx, "h", ROWS, use_ray=False)
    nb = hb.nodes(n_rows)
    return [np.asarray(nb._block(i)[: min(ROWS, n_rows - i * ROWS)]).tobytes() for i in range(len(nb.blocks))], hb


def _stored(bank: Bank) -> list[str]:
    return bank.parts(block_store.TABLE) if bank.exists(block_store.TABLE) else []


def _stats(read: int = 0, written: int = 0, damaged: int = 0, read_partial: int = 0,
           written_partial: int = 0) -> dict[str, int]:
    return {"read": read, "written": written, "damaged": damaged, "read_partial": read_partial,
            "written_partial": written_partial}


def _copy_blocks(src: Bank, dst: Bank) -> None:
    """``src``'s stored blocks into ``dst``, as an append finds them (files and markers as written)."""
    (dst.path / block_store.TABLE / "_done").mkdir(parents=True, exist_ok=True)
    for part in _stored(src):
        for rel in (f"{part}.parquet", f"_done/{part}.json"):
            (dst.path / block_store.TABLE / rel).write_bytes((src.path / block_store.TABLE / rel).read_bytes())


def test_stored_blocks_are_the_gathered_bits(tmp_path: Path) -> None:
    """A history of 11 sessions: 5 complete blocks and the 6th as far as it goes (session 10) are stored on
    the first read, and a second read takes all 6 from the bank, gathering nothing: same bytes."""
    bank, ctx = seeded_bank(tmp_path / "b", {"h": 11, "g": 3})
    first, hb1 = _blocks(ctx, 44)
    assert hb1.stored.stats() == _stats(written=5, written_partial=1)
    assert len(_stored(bank)) == 6
    second, hb2 = _blocks(ctx, 44)
    assert hb2.stored.stats() == _stats(read=5, read_partial=1)
    assert hb2.reader is None  # nothing gathered
    assert second == first
    # against the whole matrix the stage shipped before blocks
    whole = _unblocked(ctx, {"segments": [["h", 0, 11, "d"]]})["matrices"][0]
    assert b"".join(first) == np.ascontiguousarray(whole).tobytes()


def test_a_stored_partial_block_is_extended_with_the_new_sessions_only(tmp_path: Path) -> None:
    """Blocks of 4 sessions. 10 sessions store block 2 as far as session 10 (sessions 8-9); an append to 11
    reads it and gathers session 10 alone, stores block 2 as far as 11 (the older partial dropped), and an
    append to 13 completes block 2 from it (gathering sessions 11-12 only) and stores block 3 as far as 13.
    Every block equals a fresh gather's (a bank of the same history without stored blocks) and the matrix's."""
    rows = 16  # 4 sessions a block
    short, sctx = seeded_bank(tmp_path / "b10", {"h": 10})
    HistoryBlocks(sctx, "h", rows, use_ray=False).nodes(40)
    assert [p.split("-")[-2:] for p in _stored(short)][-1][0] == "p000000010"
    prev = short
    for n, stats, first in ((11, _stats(read=2, read_partial=1, written_partial=1), 10),
                            (13, _stats(read=2, read_partial=1, written=1, written_partial=1), 11)):
        bank, ctx = seeded_bank(tmp_path / f"b{n}", {"h": n})
        _copy_blocks(prev, bank)
        hb = HistoryBlocks(ctx, "h", rows, use_ray=False)
        got = hb.read_blocks(0, 4 * n)
        assert hb.stored.stats() == stats and hb.reader.first == first
        fresh, fctx = seeded_bank(tmp_path / f"fresh{n}", {"h": n})
        want = HistoryBlocks(fctx, "h", rows, use_ray=False).read_blocks(0, 4 * n)
        assert sorted(got) == sorted(want) and all(got[i].tobytes() == want[i].tobytes() for i in got)
        whole = _unblocked(ctx, {"segments": [["h", 0, n, "d"]]})["matrices"][0]
        assert np.concatenate([got[i] for i in sorted(got)]).tobytes() == np.ascontiguousarray(whole).tobytes()
        partial = [p for p in _stored(bank) if "-p0" in p]
        assert len(partial) == 1 and partial[0].split("-")[-2] == f"p{n:09d}"  # the older partial dropped
        assert len(_stored(bank)) == n // 4 + 1
        prev = bank


def test_a_changed_prefix_is_not_taken_from_a_stale_partial_block(tmp_path: Path) -> None:
    """10 sessions store block 2 as far as session 10; the same history with session 9 edited (other texts,
    other vectors), then grown to 11, names another prefix from session 9 on: the stale partial block is not
    read (block 2 is gathered from session 8), the blocks equal a fresh gather's, and the stale part is
    replaced by this history's."""
    rows = 16
    short, sctx = seeded_bank(tmp_path / "b10", {"h": 10})
    HistoryBlocks(sctx, "h", rows, use_ray=False).nodes(40)
    stale = [p for p in _stored(short) if "-p0" in p]
    for n in (10, 11):  # the same length (the partial block would be the whole block) and longer
        bank, ctx = seeded_bank(tmp_path / f"edited{n}", {"h": n}, changed=frozenset({("h", 9)}))
        _copy_blocks(short, bank)
        hb = HistoryBlocks(ctx, "h", rows, use_ray=False)
        got = hb.read_blocks(0, 4 * n)
        assert hb.stored.stats() == _stats(read=2, written_partial=1) and hb.reader.first == 8
        fresh, fctx = seeded_bank(tmp_path / f"fresh{n}", {"h": n}, changed=frozenset({("h", 9)}))
        want = HistoryBlocks(fctx, "h", rows, use_ray=False).read_blocks(0, 4 * n)
        assert all(got[i].tobytes() == want[i].tobytes() for i in want) and sorted(got) == sorted(want)
        assert got[2][4:8].tobytes() != HistoryBlocks(sctx, "h", rows, use_ray=False).read_blocks(2, 40)[2][4:8].tobytes()
        assert not set(stale) & set(_stored(bank))


def test_an_append_reads_the_stored_blocks_and_its_edges_equal_a_fresh_build(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks stored for 9 sessions serve an append to 13 (the same first 9 sessions: seeded vectors
    of the same history id and seed): its unit reads 4 stored blocks and block 4 as far as session 9,
    gathers from session 9 on, and its tables equal those of the whole matrix byte for byte."""
    monkeypatch.setattr(blocks, "BLOCK_ROWS", ROWS)
    short, sctx = seeded_bank(tmp_path / "short", {"h": 9})
    _blocks(sctx, 36)
    long, lctx = seeded_bank(tmp_path / "long", {"h": 13})
    _copy_blocks(short, long)
    assert len(_stored(long)) == 5
    unit = {"segments": [["h", 9, 13, "d13"]]}
    payload = AssociateStage().inputs(lctx, unit)
    hb = lctx.scratch["node_blocks"]["h"]
    assert hb.stored.stats()["read"] == 4 and hb.stored.stats()["read_partial"] == 1 and hb.reader.first == 9
    got = AssociateStage.run(None, payload, _params(lctx))
    want = AssociateStage.run(None, _unblocked(lctx, unit), _params(lctx))
    assert got["edges"].num_rows > 0
    assert {k: _ipc(t) for k, t in got.items()} == {k: _ipc(t) for k, t in want.items()}
    assert len(_stored(long)) == 7  # blocks 4 and 5 (sessions 8-11) stored, and block 6 as far as session 13


@pytest.mark.parametrize("n, damaged, stats", [(6, 1, _stats(read=2, written=1, damaged=1)),
                                                (7, 3, _stats(read=3, written_partial=1, damaged=1))])
def test_a_damaged_block_is_gathered_again_and_rewritten(tmp_path: Path, caplog: pytest.LogCaptureFixture, n: int,
                                                        damaged: int, stats: dict[str, int]) -> None:
    """A damaged complete block, and a damaged partial one (block 3 of 7 sessions): logged, gathered, stored again."""
    bank, ctx = seeded_bank(tmp_path / "b", {"h": n})
    first, _ = _blocks(ctx, 4 * n)
    part = sorted(_stored(bank))[damaged]
    damage_part(bank, block_store.TABLE, part)
    with caplog.at_level(logging.WARNING):
        again, hb = _blocks(ctx, 4 * n)
    assert "damaged" in caplog.text
    assert hb.stored.stats() == stats
    assert again == first
    assert bank.verify_part(block_store.TABLE, part)  # written again, whole


def test_a_part_gone_after_its_check_is_gathered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A stored part that cannot be read once verified (another run replaced it: ``answer`` reads the bank
    without its lock while ``index`` extends the last block) is logged and gathered, not an error."""
    bank, ctx = seeded_bank(tmp_path / "b", {"h": 7})
    want, _ = _blocks(ctx, 28)
    real = Bank.read

    def gone(self, name, *args, **kwargs):
        if name == block_store.TABLE:
            raise BankError(f"{name}: unreadable Parquet part (No such file or directory)")
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(Bank, "read", gone)
    with caplog.at_level(logging.WARNING):
        got, hb = _blocks(ctx, 28)
    assert "could not read stored node block" in caplog.text
    assert got == want and hb.reader.first == 0


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
