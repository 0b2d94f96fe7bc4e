"""SpilledVectors: one pass over ``embeddings`` (newest part first, only the row groups it needs) gives the vectors that Bank.read (its de-duplication included)
gives, read back from the spill file bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from memgas.pipeline import spilled_vectors
from memgas.pipeline.bank import Bank
from memgas.pipeline.errors import BankError
from memgas.pipeline.hashing import text_hash
from memgas.pipeline.schema import embeddings_schema
from memgas.pipeline.spilled_vectors import SpilledVectors

DIM = 8


def _part(rows: list[tuple[str, str]], rng: np.random.Generator) -> pa.Table:
    vec = rng.standard_normal((len(rows), DIM)).astype(np.float32)
    return pa.table({"text_hash": [h for h, _ in rows], "encoder": [k for _, k in rows],
                     "vector": pa.FixedSizeListArray.from_arrays(pa.array(vec.ravel(), pa.float32()), DIM),
                     "truncated": [False] * len(rows), "tokens": [1] * len(rows), "tokens_dropped": [0] * len(rows)},
                    schema=embeddings_schema(DIM))


@pytest.fixture()
def bank(tmp_path: Path) -> Bank:
    """Three parts: real text hashes under two keys, ids of other lengths (as tests' banks name texts), and
    a later part that re-writes some rows with other vectors (the later row wins in Bank.read)."""
    rng = np.random.default_rng(0)
    b = Bank.create(tmp_path / "bank")
    hashes = [text_hash(f"text {i}") for i in range(300)]
    b.write_part("embeddings", "a", _part([(h, "k1") for h in hashes] + [(h, "k2") for h in hashes[:100]], rng))
    b.write_part("embeddings", "b", _part([("h/s1", "k1"), ("h/s10", "k1"), ("x", "k2"), ("ü/7", "k1")], rng))
    b.write_part("embeddings", "c", _part([(h, "k1") for h in hashes[::7]] + [("h/s1", "k1")], rng))
    return b


def _oracle(bank: Bank, key: str, hashes: list[str]) -> np.ndarray:
    """The vectors as Bank.read returns them (one read, de-duplicated: the last part's row wins)."""
    t = bank.read("embeddings", ["text_hash", "encoder", "vector"])
    t = t.filter(pc.equal(t["encoder"], key))
    row = {h: i for i, h in enumerate(t["text_hash"].to_pylist())}
    vec = t["vector"].combine_chunks().flatten().to_numpy().reshape(-1, DIM)
    return vec[[row[h] for h in sorted(hashes)]]


def test_one_pass_gives_the_vectors_bank_read_gives(bank: Bank, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spilled_vectors, "SCAN_BATCH_ROWS", 16)  # many batches per part
    hashes = [text_hash(f"text {i}") for i in range(300)]
    need = {"k1": hashes[:250] + ["h/s1", "h/s10", "ü/7"], "k2": hashes[50:100] + ["x"]}
    sv = SpilledVectors(bank, need)
    for key, want in need.items():
        for ask in (want, want[::3], want[-1:], []):
            got, row = sv.read(key, ask)
            assert row == {h: i for i, h in enumerate(sorted(set(ask)))}
            if ask:
                assert np.array_equal(got, _oracle(bank, key, ask))  # exact: the bytes of the part
            else:
                assert got.shape == (0, DIM)
    # the re-written rows hold the last part's vectors, not the first's
    first = pa.table(bank._read_part("embeddings", "a")).filter(pc.field("text_hash") == hashes[7])
    got, _ = sv.read("k1", [hashes[7]])
    assert not np.array_equal(got[0], np.asarray(first["vector"][0].as_py(), np.float32))
    sv.close()
    assert not sv.path.exists()


def test_a_text_without_a_vector_or_not_gathered_is_a_clear_error(bank: Bank) -> None:
    hashes = [text_hash(f"text {i}") for i in range(300)]
    sv = SpilledVectors(bank, {"k1": hashes[:10] + [text_hash("never encoded")], "k2": hashes[:3]})
    with pytest.raises(BankError, match=r"1 texts have no 'k1' embedding .*"
                                        + text_hash("never encoded") + r".*memgas index"):
        sv.read("k1", hashes[:10] + [text_hash("never encoded")])
    with pytest.raises(BankError, match="have no 'k1' embedding"):
        sv.read("k1", [hashes[20]])  # in the bank, but not asked for when gathering
    with pytest.raises(BankError, match="no 'k3' embeddings were gathered"):
        sv.read("k3", hashes[:1])
    got, _ = sv.read("k1", hashes[:10])
    assert np.array_equal(got, _oracle(bank, "k1", hashes[:10]))


def test_a_killed_process_leaves_no_spill_file(bank: Bank, tmp_path: Path) -> None:
    """The spill file is unlinked once open: a process SIGKILLed while it holds the vectors leaves nothing in
    the spill directory (it used to leave a memgas-vectors-* directory with the whole file)."""
    import signal
    import subprocess
    import sys

    spill = tmp_path / "spill"
    spill.mkdir()
    code = ("import os, signal, sys\n"
            "from memgas.pipeline.bank import Bank\n"
            "from memgas.pipeline.spilled_vectors import SpilledVectors\n"
            "from memgas.pipeline.hashing import text_hash\n"
            "sv = SpilledVectors(Bank(sys.argv[1]), {'k1': [text_hash(f'text {i}') for i in range(300)]}, sys.argv[2])\n"
            "assert sv.read('k1', [text_hash('text 3')])[0].shape == (1, 8)\n"
            "print(os.fstat(sv._fd).st_size, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    p = subprocess.run([sys.executable, "-c", code, str(bank.path), str(spill)], capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert int(p.stdout.strip()) == 300 * 4 * DIM  # the file was written, then the process killed
    assert list(spill.iterdir()) == []


def test_a_full_disk_names_the_spill_directory_and_the_size(bank: Bank, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    def full(fd: int, data: bytes, offset: int) -> int:  # a full disk cannot be made here: ENOSPC as the kernel says it
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(spilled_vectors.os, "pwrite", full)
    with pytest.raises(OSError, match=rf"spilling a long history's vectors to {tmp_path}: No space left on device; "
                                      r"it needs 0\.00 GiB there \(set TMPDIR") as e:
        SpilledVectors(bank, {"k1": [text_hash(f"text {i}") for i in range(300)]}, tmp_path)
    assert e.value.errno == errno.ENOSPC and list(tmp_path.glob("memgas-vectors-*")) == []


def test_a_hash_twice_in_one_batch_keeps_its_later_row(tmp_path: Path) -> None:
    """Bank.read keeps the later of two rows of one (text hash, encoder) in one part; so does the spill (its
    writes follow the table's order within a batch too)."""
    rng = np.random.default_rng(1)
    b = Bank.create(tmp_path / "bank")
    hashes = [text_hash(f"text {i}") for i in range(40)]
    b.write_part("embeddings", "a", _part([(h, "k1") for h in hashes + hashes[::3] + hashes[5:9]], rng))
    sv = SpilledVectors(b, {"k1": hashes})
    got, _ = sv.read("k1", hashes)
    assert np.array_equal(got, _oracle(b, "k1", hashes))
    t = b.read("embeddings", ["text_hash", "vector"], dedupe=False)
    last = {h: np.asarray(v, np.float32) for h, v in zip(t["text_hash"].to_pylist(), t["vector"].to_pylist())}
    assert all(np.array_equal(got[i], last[h]) for i, h in enumerate(sorted(hashes)))


def _group_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[str, ...], object]]:
    """Every ``Bank.iter_groups`` from now on: (part, columns, row groups or None for all)."""
    reads: list[tuple[str, tuple[str, ...], object]] = []
    real = Bank.iter_groups

    def spy(self, name, part, columns, *, batch_rows, groups=None):
        reads.append((part, tuple(columns), None if groups is None else tuple(groups)))
        return real(self, name, part, columns, batch_rows=batch_rows, groups=groups)

    monkeypatch.setattr(Bank, "iter_groups", spy)
    return reads


def test_newest_parts_first_and_only_the_row_groups_that_hold_a_needed_row(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of 16-row groups: the vectors are read only from the row groups that hold a slot still open,
    newest part first, and an earlier part is not read once every slot is filled (an append's new texts,
    beside the large compacted part); the vectors are Bank.read's either way."""
    from memgas.pipeline import bank as bank_mod

    monkeypatch.setattr(bank_mod, "ROW_GROUP_ROWS", {**bank_mod.ROW_GROUP_ROWS, "embeddings": 16})
    rng = np.random.default_rng(1)
    b = Bank.create(tmp_path / "bank")
    old = [text_hash(f"old {i}") for i in range(160)]  # 10 row groups
    new = [text_hash(f"new {i}") for i in range(40)]
    b.write_part("embeddings", "a-large", _part([(h, "k1") for h in old], rng))
    b.write_part("embeddings", "b-append", _part([(h, "k1") for h in new] + [(old[3], "k1")], rng))
    reads = _group_reads(monkeypatch)
    sv = SpilledVectors(b, {"k1": new[::2] + [old[3]]})
    assert [r[0] for r in reads] == ["b-append", "b-append"]  # every slot filled there: a-large never read
    want = new[::2] + [old[3]]
    assert sv.read("k1", want)[0].tobytes() == _oracle(b, "k1", want).tobytes()  # old[3]: b-append's row
    reads.clear()
    want = new[:3] + [old[5], old[150]]
    sv = SpilledVectors(b, {"k1": want})
    vector_reads = [(p, g) for p, cols, g in reads if "vector" in cols]
    assert vector_reads == [("b-append", (0,)), ("a-large", (0, 9))]  # the groups of rows 0-15 and 144-159
    assert sv.read("k1", want)[0].tobytes() == _oracle(b, "k1", want).tobytes()


def _sorted_part(rows: list[tuple[str, str]], rng: np.random.Generator) -> pa.Table:
    """A part as compaction writes it: sorted by key (text hash, encoder)."""
    return _part(rows, rng).sort_by([("text_hash", "ascending"), ("encoder", "ascending")])


def test_a_sorted_part_is_read_only_in_the_row_groups_whose_key_range_holds_a_needed_hash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large part sorted by key (as compacted) in 16-row groups: the few texts the newest part lacks are
    looked for only in the row groups whose text_hash statistics (min, max) can hold them, key columns
    included; the vectors are Bank.read's."""
    from memgas.pipeline import bank as bank_mod

    monkeypatch.setattr(bank_mod, "ROW_GROUP_ROWS", {**bank_mod.ROW_GROUP_ROWS, "embeddings": 16})
    rng = np.random.default_rng(2)
    b = Bank.create(tmp_path / "bank")
    old = sorted(text_hash(f"old {i}") for i in range(160))  # 10 row groups, in key order
    new = [text_hash(f"new {i}") for i in range(40)]
    b.write_part("embeddings", "a-large", _sorted_part([(h, "k1") for h in old], rng))
    b.write_part("embeddings", "b-append", _sorted_part([(h, "k1") for h in new], rng))
    reads = _group_reads(monkeypatch)
    want = new[:3] + [old[5], old[150], old[151]]
    sv = SpilledVectors(b, {"k1": want})
    assert [(p, g) for p, cols, g in reads if p == "a-large"] == [("a-large", (0, 9)), ("a-large", (0, 9))]
    assert sv.read("k1", want)[0].tobytes() == _oracle(b, "k1", want).tobytes()


def test_row_group_statistics_change_no_vector(bank: Bank, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same vectors with the statistics as without them (every row group's keys read), on parts of real
    hashes, ids shorter and longer than them, non-ASCII ids, a row re-written by a later part, and a part
    written without statistics; both equal Bank.read's."""
    from memgas.pipeline import bank as bank_mod
    from memgas.pipeline import bank_files

    monkeypatch.setattr(bank_mod, "ROW_GROUP_ROWS", {**bank_mod.ROW_GROUP_ROWS, "embeddings": 8})
    rng = np.random.default_rng(4)
    hashes = [text_hash(f"text {i}") for i in range(300)]
    bank.write_part("embeddings", "d", _sorted_part([(h, "k1") for h in hashes[::5]] + [("h/s10", "k1"), ("zz", "k2")],
                                                    rng))
    plain = {**bank_files._PARQUET_OPTS, "write_statistics": False}
    monkeypatch.setattr(bank_files, "_TABLE_PARQUET_OPTS", {**bank_files._TABLE_PARQUET_OPTS, "embeddings": plain})
    bank.write_part("embeddings", "e", _sorted_part([(h, "k2") for h in hashes[:9]] + [("ü/7", "k1")], rng))
    assert spilled_vectors.key_ranges(bank, "e") == [None, None] and spilled_vectors.key_ranges(bank, "d")[0]
    asks = [{"k1": hashes[:250] + ["h/s1", "h/s10", "ü/7"], "k2": hashes[50:100] + ["x", "zz"]},
            {"k1": ["h/s1"], "k2": ["x"]}, {"k1": hashes[::5][:3]}, {"k2": ["zz"]}, {"k1": [hashes[7]], "k2": hashes[:2]}]
    ranges = spilled_vectors.key_ranges
    use = [True]
    monkeypatch.setattr(spilled_vectors, "key_ranges", lambda *a, **k: ranges(*a, **k) if use[0] else None)
    for need in asks:
        use[0] = True
        with_stats = SpilledVectors(bank, need)
        use[0] = False
        without = SpilledVectors(bank, need)
        for key, hs in need.items():
            got = with_stats.read(key, hs)[0]
            assert got.tobytes() == without.read(key, hs)[0].tobytes() == _oracle(bank, key, hs).tobytes()
