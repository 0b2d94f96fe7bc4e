"""Tiered compaction beside rows written again, and the count of a tiered table (memgas.pipeline.bank_compact,
Bank.count).

Content-addressed tables (``texts`` keyed by text hash, ``embeddings``, ``generations``) get rows again whose
key the large compacted part holds already (a keyword text equal to a session's text). When those rows are
the large part's rows bit for bit, the large part is left alone and they stay out of the merge of the rest;
when one differs, everything is merged and the later row wins. The oracle is the same parts merged whole
(the tier switched off): the table must read the same, every value compared exactly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from memgas.pipeline import bank_compact
from memgas.pipeline.bank import COMPACT_PREFIX, Bank
from memgas.pipeline.bank_compact import DISJOINT_FROM, _same_bits
from memgas.pipeline.hashing import text_hash
from memgas.pipeline.schema import KEYS

DIM = 4


def _embeddings(hashes: list[str], seed: int) -> pa.Table:
    vecs = np.random.default_rng(seed).standard_normal((len(hashes), DIM)).astype(np.float32)
    return pa.table({
        "text_hash": pa.array(hashes, pa.string()),
        "encoder": pa.array(["enc"] * len(hashes), pa.string()),
        "vector": pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel()), DIM),
        "truncated": pa.array([False] * len(hashes)),
        "tokens": pa.array(np.arange(len(hashes), dtype=np.int32) + seed),
        "tokens_dropped": pa.array(np.zeros(len(hashes), np.int32)),
    })


def _with_vector(t: pa.Table, row: int, vector: list[float]) -> pa.Table:
    """``t`` with the vector of ``row`` replaced (float32, bits as given: -0.0 and NaN kept)."""
    vecs = np.array(t.column("vector").to_pylist(), np.float32)
    vecs[row] = np.array(vector, np.float32)
    col = pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel()), DIM)
    return t.set_column(t.schema.get_field_index("vector"), "vector", col)


def _cat(tables: list[pa.Table]) -> pa.Table:
    """Rows of the bank (columns not null) and new ones (nullable) in one table."""
    return pa.concat_tables(tables, promote_options="permissive")


def _texts(words: list[str]) -> pa.Table:
    return pa.table({"text_hash": [text_hash(w) for w in words], "text": words})


def _base_rows(name: str) -> pa.Table:
    """900 rows, then compacted: the large part. The vector of 00003 holds a NaN and a -0.0 (compared by bits)."""
    if name == "texts":
        return _texts([f"session {i}" for i in range(900)])
    return _with_vector(_embeddings([f"{i:05d}" for i in range(900)], seed=0), 3, [float("nan"), -0.0, 0.0, 1.0])


def _new_rows(name: str, first: int, n: int) -> pa.Table:
    if name == "texts":
        return _texts([f"keywords {first + i}" for i in range(n)])
    return _embeddings([f"{first + i:05d}" for i in range(n)][::-1], seed=first)


def _repeats(bank: Bank, name: str, keys: list[str]) -> pa.Table:
    """The rows the bank holds for ``keys`` (text hashes), as they are: written again, they are equal."""
    t = bank.read(name)
    return t.filter(pc.is_in(t.column("text_hash"), value_set=pa.array(keys)))


def _hashes(name: str, idx: list[int]) -> list[str]:
    return [text_hash(f"session {i}") for i in idx] if name == "texts" else [f"{i:05d}" for i in idx]


def _two_banks(tmp_path: Path, name: str) -> tuple[Bank, Bank, str]:
    """The bank under test and the oracle's, each with the large compacted part; returns the part's name."""
    banks = []
    for sub in ("tiered", "full"):
        bank = Bank.create(tmp_path / sub)
        bank.write_part(name, "unit-0", _base_rows(name))
        bank.compact(name)
        banks.append(bank)
    (base,) = banks[0].parts(name)
    return banks[0], banks[1], base


def _write_both(banks: tuple[Bank, Bank], name: str, part: str, t: pa.Table) -> None:
    for bank in banks:
        bank.write_part(name, part, t)


def _merged_parts(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The parts of every merge from now on (``Bank.iter_merged``): the large part must be in none."""
    merges: list[list[str]] = []
    iter_merged = Bank.iter_merged

    def spied(self: Bank, name: str, parts: list[str] | None = None):
        merges.append(list(parts or []))
        return iter_merged(self, name, parts)

    monkeypatch.setattr(Bank, "iter_merged", spied)
    return merges


def _full_compact(bank: Bank, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle: the same parts merged whole, as when no part is large enough to be left alone."""
    with monkeypatch.context() as m:
        m.setattr(bank_compact, "TIER_RATIO", 10**9)
        bank.compact(name)
    assert len(bank.parts(name)) == 1


def _sorted(bank: Bank, name: str) -> pa.Table:
    return bank.read(name).sort_by([(k, "ascending") for k in KEYS[name]]).combine_chunks()


def _vector_bits(t: pa.Table) -> np.ndarray:
    return np.asarray(t.column("vector").combine_chunks().flatten()).view(np.uint32)


def _identical(a: pa.Table, b: pa.Table) -> bool:
    """``Table.equals``, and vectors compared by their bits: ``equals`` takes -0.0 for 0.0, a NaN for no NaN."""
    if "vector" not in a.column_names:
        return a.equals(b)
    bits = [_vector_bits(t) for t in (a, b)]
    rest = [t.drop_columns(["vector"]) for t in (a, b)]
    return a.schema.equals(b.schema) and np.array_equal(*bits) and rest[0].equals(rest[1])


def _marker(bank: Bank, name: str, part: str) -> dict:
    return json.loads((bank.path / name / "_done" / f"{part}.json").read_text())


def _key_count(bank: Bank, name: str) -> int:
    return bank.read(name, list(KEYS[name])).num_rows


@pytest.mark.parametrize("name", ["texts", "embeddings"])
def test_rows_written_again_as_they_are_leave_the_large_part_alone(tmp_path: Path, name: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An append whose part repeats three keys of the large part with equal rows (the vector with a NaN and
    a -0.0 among them) and adds 40: the large part stays (same name, same bytes), the new part holds the 40,
    and the table reads exactly as the full merge's. A second append repeats keys of both parts: the same."""
    bank, full, base = _two_banks(tmp_path, name)
    base_bytes = (bank.path / name / f"{base}.parquet").read_bytes()
    again = _repeats(bank, name, _hashes(name, [3, 500, 899]))
    assert again.num_rows == 3
    _write_both((bank, full), name, "unit-1", _cat([_new_rows(name, 1000, 20), again, _new_rows(name, 1020, 20)]))
    merges = _merged_parts(monkeypatch)
    assert bank.compact(name) == 940 and merges == [["unit-1"]]
    _full_compact(full, name, monkeypatch)
    parts = bank.parts(name)
    assert len(parts) == 2 and base in parts
    assert (bank.path / name / f"{base}.parquet").read_bytes() == base_bytes
    (merged,) = [p for p in parts if p != base]
    assert bank.part_rows(name, merged) == 40 and _marker(bank, name, merged)[DISJOINT_FROM] == base
    assert _identical(_sorted(bank, name), _sorted(full, name))
    assert bank.count(name) == full.count(name) == _key_count(bank, name) == 940

    second = _cat([_repeats(bank, name, _hashes(name, [7, 0])),
                               bank.read(name, parts=[merged]).slice(5, 2), _new_rows(name, 2000, 10)])
    _write_both((bank, full), name, "unit-2", second)
    merges.clear()
    assert bank.compact(name) == 950 and merges == [[merged, "unit-2"]]
    _full_compact(full, name, monkeypatch)
    parts = bank.parts(name)
    assert len(parts) == 2 and base in parts and merged not in parts
    (merged,) = [p for p in parts if p != base]
    assert bank.part_rows(name, merged) == 50 and _marker(bank, name, merged)[DISJOINT_FROM] == base
    assert _identical(_sorted(bank, name), _sorted(full, name))
    assert bank.count(name) == _key_count(full, name) == 950


def test_a_part_that_only_repeats_rows_of_the_large_part_is_dropped(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row of the append is the large part's already: nothing is written, the append's part goes."""
    bank, full, base = _two_banks(tmp_path, "texts")
    again = _repeats(bank, "texts", _hashes("texts", [1, 2, 9]))
    _write_both((bank, full), "texts", "unit-1", _cat([again, again.slice(1, 1)]))
    merges = _merged_parts(monkeypatch)
    assert bank.compact("texts") == 900 and merges == []
    _full_compact(full, "texts", monkeypatch)
    assert bank.parts("texts") == [base] == full.parts("texts")  # the full merge gives the same bytes
    assert _sorted(bank, "texts").equals(_sorted(full, "texts"))


@pytest.mark.parametrize("change", ["sign of a zero", "a NaN's payload", "tokens", "a null"])
def test_a_repeated_key_with_another_value_merges_everything_and_the_later_row_wins(
        tmp_path: Path, change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One repeat equal, one that differs only in bits ``==`` does not see (0.0 and -0.0, two NaNs) or in a
    plain value: everything is merged into one part, which reads as the oracle's, the later row winning."""
    bank, full, base = _two_banks(tmp_path, "embeddings")
    again = _repeats(bank, "embeddings", ["00003", "00004"])  # 00003: NaN, -0.0, 0.0, 1.0
    if change == "sign of a zero":
        changed = _with_vector(again, 0, [float("nan"), 0.0, 0.0, 1.0])
    elif change == "a NaN's payload":
        payload = np.array([0x7FC00001], np.uint32).view(np.float32)[0]
        changed = _with_vector(again, 0, [payload, -0.0, 0.0, 1.0])
    elif change == "tokens":
        changed = again.set_column(4, "tokens", pa.array([7, again.column("tokens")[1].as_py()], pa.int32()))
    else:
        changed = again.set_column(3, "truncated", pa.array([None, again.column("truncated")[1].as_py()]))
    _write_both((bank, full), "embeddings", "unit-1", _cat([changed, _new_rows("embeddings", 1000, 5)]))
    assert bank.compact("embeddings") == 905
    _full_compact(full, "embeddings", monkeypatch)
    assert len(bank.parts("embeddings")) == 1 and base not in bank.parts("embeddings")
    got = _sorted(bank, "embeddings")
    assert _identical(got, _sorted(full, "embeddings"))
    row = got.filter(pc.equal(got.column("text_hash"), "00003"))
    assert np.array_equal(_vector_bits(row), _vector_bits(changed.slice(0, 1)))
    columns = ["tokens", "truncated"]
    assert row.select(columns).to_pylist() == changed.slice(0, 1).select(columns).to_pylist()


def test_same_bits_compares_floats_by_their_bits_and_skips_what_nulls_hide() -> None:
    f32 = pa.float32()
    assert not _same_bits(pa.array([0.0], f32), pa.array([-0.0], f32))
    assert _same_bits(pa.array([float("nan")], f32), pa.array([float("nan")], f32))
    assert not _same_bits(pa.array([1, None]), pa.array([1, 2]))
    vec = pa.list_(f32, 2)
    hidden = pa.FixedSizeListArray.from_arrays(pa.array([1, 2, 3, 4], f32), 2, mask=pa.array([False, True]))
    other = pa.FixedSizeListArray.from_arrays(pa.array([1, 2, 9, 9], f32), 2, mask=pa.array([False, True]))
    assert hidden.type == vec and _same_bits(hidden, other)  # the values under a null list do not count
    assert not _same_bits(pa.array([[1.0], [2.0, 3.0]]), pa.array([[1.0, 2.0], [3.0]]))
    assert _same_bits(pa.array([{"a": 1.5}, None]), pa.array([{"a": 1.5}, None]))
    assert not _same_bits(pa.array([1], pa.int32()), pa.array([1], pa.int64()))


# -- count: the two parts of a tiered table are added, not read -------------------------------------------------
def _counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every ``Bank.read`` from now on, by table (count reads keys through it)."""
    calls: list[str] = []
    read = Bank.read

    def counted(self: Bank, name: str, *args, **kwargs) -> pa.Table:
        calls.append(name)
        return read(self, name, *args, **kwargs)

    monkeypatch.setattr(Bank, "read", counted)
    return calls


def _tiered(tmp_path: Path) -> tuple[Bank, str, str]:
    """An embeddings table of the large part and a part merged beside it (which holds no key of the large one:
    the append repeated two of them)."""
    bank = Bank.create(tmp_path / "b")
    bank.write_part("embeddings", "unit-0", _base_rows("embeddings"))
    bank.compact("embeddings")
    (base,) = bank.parts("embeddings")
    bank.write_part("embeddings", "unit-1", _cat([_repeats(bank, "embeddings", ["00001", "00002"]),
                                                              _new_rows("embeddings", 1000, 30)]))
    bank.compact("embeddings")
    (merged,) = [p for p in bank.parts("embeddings") if p != base]
    assert base in bank.parts("embeddings")
    return bank, base, merged


def test_count_of_a_tiered_table_reads_no_key_and_an_extra_part_reads_them_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bank, base, merged = _tiered(tmp_path)
    expected = _key_count(bank, "embeddings")
    calls = _counting_reads(monkeypatch)
    assert bank.count("embeddings") == expected == 930 and calls == []
    assert bank.update_manifest()["row_counts"]["embeddings"] == 930 and calls == []
    # a part that is not compacted (an append, not merged yet), one key of each part written again: the
    # recorded count and the new part's keys not in the others (no de-duplicating read); unrecorded: read
    again = _repeats(bank, "embeddings", ["00005", "01003"])
    bank.write_part("embeddings", "unit-2", _cat([again, _new_rows("embeddings", 2000, 4)]))
    calls.clear()
    assert bank.count("embeddings") == 934 and calls == []
    assert bank.count("embeddings") == _key_count(bank, "embeddings")
    m = json.loads((bank.path / "manifest.json").read_text())
    del m["row_count_of"]  # a manifest written before the record
    (bank.path / "manifest.json").write_text(json.dumps(m))
    calls.clear()
    assert Bank(bank.path).count("embeddings") == 934 and calls == ["embeddings"]


def test_a_read_of_a_tiered_table_skips_the_de_duplication_and_gives_the_same_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two parts recorded disjoint hold each key once: Bank.read gives their rows without the group-by of
    de-duplication, the rows de-duplication gives; without the record it de-duplicates again."""
    from memgas.pipeline import bank as bank_module

    bank, base, merged = _tiered(tmp_path)
    assert sorted(bank.parts("embeddings")) == sorted([base, merged])
    want = bank_module.dedupe_last(pa.concat_tables([bank.read("embeddings", parts=[p]) for p in bank.parts("embeddings")]),
                                   ["text_hash", "encoder"])
    grouped: list[int] = []
    real = bank_module.dedupe_last
    monkeypatch.setattr(bank_module, "dedupe_last", lambda t, k: grouped.append(t.num_rows) or real(t, k))
    got = bank.read("embeddings")
    assert grouped == [] and _identical(got, want) and got.num_rows == 930
    marker = bank.path / "embeddings" / "_done" / f"{merged}.json"
    info = json.loads(marker.read_text())
    del info[DISJOINT_FROM]
    marker.write_text(json.dumps(info))
    assert _identical(bank.read("embeddings"), want) and grouped == [930]


def test_count_reads_keys_without_the_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bank written before the record (its marker without it): the keys are read, the count the same."""
    bank, base, merged = _tiered(tmp_path)
    marker = bank.path / "embeddings" / "_done" / f"{merged}.json"
    info = json.loads(marker.read_text())
    del info[DISJOINT_FROM]
    marker.write_text(json.dumps(info))
    calls = _counting_reads(monkeypatch)
    assert bank.count("embeddings") == 930 and calls == ["embeddings"]


def test_a_large_part_with_a_key_twice_gets_no_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compacted part written whole (``Bank.write``) with a key twice: its rows are not its keys, so the part
    merged beside it records nothing, and count reads the keys (899 + 30)."""
    bank = Bank.create(tmp_path / "b")
    rows = _base_rows("embeddings")
    bank.write("embeddings", _cat([rows, rows.slice(10, 1)]).slice(1))
    (base,) = bank.parts("embeddings")
    bank.write_part("embeddings", "unit-1", _new_rows("embeddings", 1000, 30))
    assert bank.compact("embeddings") == 930  # as before: the rows of the parts, not the keys
    (merged,) = [p for p in bank.parts("embeddings") if p != base]
    assert DISJOINT_FROM not in _marker(bank, "embeddings", merged)
    calls = _counting_reads(monkeypatch)
    assert bank.count("embeddings") == 929 and calls == ["embeddings"]


# -- crash safety ---------------------------------------------------------------------------------------------
def _killed_compaction(bank: Bank, name: str, fault: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MEMGAS_FAULT": fault}
    code = f"from memgas.pipeline.bank import Bank; Bank({str(bank.path)!r}).compact({name!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]


@pytest.mark.parametrize(("fault", "extra"), [("kill@bank:compact:merging", True),
                                              ("kill@bank:compact:after-new", True),
                                              ("kill@bank:compact:dropped", False)])
def test_a_kill_while_repeated_rows_are_left_out_loses_nothing(tmp_path: Path, fault: str, extra: bool) -> None:
    """Killed while merging, after the new part's commit, or while the append's parts of repeated rows alone
    are dropped: the table reads as before and counts its keys; the next compaction ends as an uninterrupted
    one (the large part untouched)."""
    def build(path: Path) -> tuple[Bank, str]:
        bank = Bank.create(path)
        bank.write_part("texts", "unit-0", _base_rows("texts"))
        bank.compact("texts")
        (base,) = bank.parts("texts")
        for i in range(2):  # two keys of the large part written again in each, and 10 new keys or none
            new = [_new_rows("texts", 1000 + 10 * i, 10)] if extra else []
            bank.write_part("texts", f"unit-{i + 1}",
                            _cat([_repeats(bank, "texts", _hashes("texts", [4 + i, 8])), *new]))
        return bank, base

    clean, _ = build(tmp_path / "clean")
    clean.compact("texts")
    bank, base = build(tmp_path / "b")
    before = _sorted(bank, "texts")
    _killed_compaction(bank, "texts", fault)
    bank = Bank(bank.path)
    assert base in bank.parts("texts") and _sorted(bank, "texts").equals(before)
    assert bank.count("texts") == before.num_rows == 900 + 20 * extra
    bank.compact("texts")
    assert bank.parts("texts") == clean.parts("texts") and base in clean.parts("texts")
    assert _sorted(bank, "texts").equals(before)
    assert not [f for f in (bank.path / "texts").iterdir() if f.name.startswith(".")]
    assert all(p.startswith(COMPACT_PREFIX) for p in bank.parts("texts"))


def test_the_manifest_count_of_the_same_parts_is_taken_and_another_part_is_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """update_manifest records which parts each count is of; a later count of the same parts (names and
    recorded digests) takes it without reading a key, and a part added, replaced or dropped is counted again."""
    bank = Bank.create(tmp_path / "b")
    bank.write_part("embeddings", "unit-0", _base_rows("embeddings"))
    bank.compact("embeddings")
    bank.write_part("embeddings", "unit-1", _cat([_repeats(bank, "embeddings", ["00001"]), _new_rows("embeddings", 1000, 5)]))
    expected = _key_count(bank, "embeddings")
    bank.update_manifest()
    calls = _counting_reads(monkeypatch)
    assert bank.count("embeddings") == expected == 905 and calls == []
    bank.write_part("embeddings", "unit-2", _new_rows("embeddings", 2000, 3))  # not in the recorded parts
    assert bank.count("embeddings") == 908 and calls == []  # only added: from the record (_grown_count)
    bank.write_part("embeddings", "unit-2", _new_rows("embeddings", 3000, 4))  # the same name, other bytes
    assert bank.count("embeddings") == 909 == _key_count(bank, "embeddings")
    bank.update_manifest()
    calls.clear()
    assert bank.count("embeddings") == 909 and calls == []
    bank.drop_part("embeddings", "unit-2")
    assert bank.count("embeddings") == 905 and calls == ["embeddings"]


def test_update_manifest_counts_what_changed_since_the_last_update(tmp_path: Path) -> None:
    """The counts update_manifest writes are those of the parts now, not the ones it recorded before."""
    bank = Bank.create(tmp_path / "b")
    bank.write_part("embeddings", "unit-0", _base_rows("embeddings"))
    assert bank.update_manifest()["row_counts"]["embeddings"] == 900
    bank.write_part("embeddings", "unit-1", _new_rows("embeddings", 1000, 7))
    assert bank.update_manifest()["row_counts"]["embeddings"] == 907
    bank.compact("embeddings")
    assert bank.update_manifest()["row_counts"]["embeddings"] == 907 == _key_count(bank, "embeddings")
    assert json.loads((bank.path / "manifest.json").read_text())["row_counts"]["embeddings"] == 907


def _oracle_count(bank: Bank, name: str) -> int:
    """Distinct keys over every part, each part read on its own into a Python set."""
    keys = list(KEYS[name])
    return len({tuple(r[k] for k in keys) for p in bank.parts(name) for r in bank.read(name, keys, parts=[p]).to_pylist()})


@pytest.mark.parametrize("name", ["texts", "embeddings"])
def test_a_count_after_parts_were_only_added_starts_from_the_recorded_one(
        tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts added since update_manifest (an ingest's): the count is the recorded one plus the added keys the
    other parts do not hold, without a de-duplicating read: equal to distinct keys counted by hand, with
    keys repeated from the large part, from a part added before, and within the added part. A part of the
    record rewritten or gone, or a recorded count of parts that were summed: counted by reading the keys."""
    bank = Bank.create(tmp_path / "b")
    bank.write_part(name, "unit-0", _base_rows(name))
    bank.compact(name)
    bank.write_part(name, "unit-1", _cat([_repeats(bank, name, _hashes(name, [1, 2])), _new_rows(name, 1000, 5)]))
    bank.update_manifest()
    assert bank.manifest["row_counts"][name] == _oracle_count(bank, name) == 905
    unit1 = bank.read(name, parts=["unit-1"])
    bank.write_part(name, "unit-2", _cat([_repeats(bank, name, _hashes(name, [3])), unit1.slice(0, 1),
                                          unit1.slice(3, 1), _new_rows(name, 2000, 4), _new_rows(name, 2000, 2)]))
    bank.write_part(name, "unit-3", _new_rows(name, 3000, 3))
    calls = _counting_reads(monkeypatch)
    got = bank.count(name)
    assert calls == [] and got == _oracle_count(bank, name) == 912
    assert bank.update_manifest()["row_counts"][name] == 912
    bank.write_part(name, "unit-3", _new_rows(name, 4000, 6))  # a recorded part rewritten: read again
    calls.clear()
    got = bank.count(name)
    assert calls == [name] and got == _oracle_count(bank, name) == 915
    bank.update_manifest()
    bank.drop_part(name, "unit-2")  # gone: read again
    calls.clear()
    got = bank.count(name)
    assert calls == [name] and got == _oracle_count(bank, name)
    # a record of one part (its rows summed, not its keys): no start from it
    other = Bank.create(tmp_path / "c")
    rows = _base_rows(name)
    other.write(name, _cat([rows, rows.slice(10, 1)]).slice(1))  # one part holding a key twice
    assert other.update_manifest()["row_counts"][name] == 900
    other.write_part(name, "unit-1", _new_rows(name, 1000, 2))
    calls.clear()
    got = other.count(name)
    assert calls == [name] and got == _oracle_count(other, name) == 901


@pytest.mark.parametrize("record", [[[["unit-0"], "x"]], [["unit-0"]], "unit-0", [[None, None]], {"a": 1}, [[1, 2]]])
def test_a_malformed_count_record_counts_every_key(tmp_path: Path, record: object,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest whose ``row_count_of`` is not a list of [part, digest] pairs (hand-edited, another writer):
    the count reads every key, as without a record; so does a negative recorded count."""
    bank = Bank.create(tmp_path / "b")
    bank.write_part("texts", "unit-0", _base_rows("texts"))
    bank.compact("texts")
    bank.write_part("texts", "unit-1", _new_rows("texts", 1000, 5))
    bank.update_manifest()
    bank.write_part("texts", "unit-2", _new_rows("texts", 2000, 3))
    original = json.loads((bank.path / "manifest.json").read_text())
    for field, value in (("row_count_of", {"texts": record}), ("row_counts", {"texts": -5})):
        m = {**original, field: value}
        (bank.path / "manifest.json").write_text(json.dumps(m))
        calls = _counting_reads(monkeypatch)
        got = Bank(bank.path).count("texts")
        assert calls == ["texts"] and got == 908
        monkeypatch.undo()


def _ingested_texts(tmp_path: Path) -> Bank:
    """``texts`` as an ingest leaves it beside a stage's compacted rows: a large compacted part, a second one,
    and two parts of ingest's own (never compacted), counted by update_manifest."""
    bank = Bank.create(tmp_path / "b")
    bank.write_part("texts", "unit-0", _base_rows("texts"))
    bank.compact("texts")
    bank.write_part("texts", "unit-1", _new_rows("texts", 1000, 5))
    bank.compact("texts")
    from memgas.pipeline.bank_files import INGEST_TABLES
    from memgas.pipeline.schema import schema_for

    ingested = {"ingest-a-00000": _cat([_new_rows("texts", 2000, 6), _repeats(bank, "texts", _hashes("texts", [7]))]),
                "ingest-a-x0001-00000": _new_rows("texts", 3000, 2)}
    for part, rows in ingested.items():
        for name in INGEST_TABLES:
            bank.write_part(name, part, rows if name == "texts" else schema_for(name).empty_table())
    bank.commit_ingest(list(ingested))  # counts every table (update_manifest)
    return bank


def test_a_compaction_records_the_count_it_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage's new rows compacted beside ingest's parts: the count before the compaction (from the record
    of fewer parts) is recorded for the parts after it, so the next count reads no key; the same count as
    keys counted by hand, and as update_manifest writes."""
    bank = _ingested_texts(tmp_path)
    assert bank.manifest["row_counts"]["texts"] == _oracle_count(bank, "texts") == 913
    unit1 = bank.read("texts", parts=["ingest-a-00000"])
    bank.write_part("texts", "unit-2", _cat([_new_rows("texts", 4000, 4), unit1.slice(0, 2),
                                             _repeats(bank, "texts", _hashes("texts", [9]))]))
    before = bank.parts("texts")
    bank.compact("texts")
    assert bank.parts("texts") != before  # merged: the record is of the parts after it
    calls = _counting_reads(monkeypatch)
    got = bank.count("texts")
    assert calls == [] and got == _oracle_count(bank, "texts") == 917
    assert bank.update_manifest()["row_counts"]["texts"] == 917


@pytest.mark.parametrize("fault", ["enospc@bank:count-record:before-rename", None])
def test_a_compaction_without_a_usable_record_or_with_a_full_disk_records_nothing(
        tmp_path: Path, fault: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """No record of these parts or of fewer (a part of the record rewritten), or a full disk while writing
    the record: the compaction ends as it would, and the next count reads every key, right."""
    bank = _ingested_texts(tmp_path)
    bank.write_part("texts", "ingest-a-x0001-00000", _new_rows("texts", 5000, 3))  # rewritten since the record
    bank.write_part("texts", "unit-2", _new_rows("texts", 4000, 4))
    if fault:
        bank.write_part("texts", "ingest-a-x0001-00000", _new_rows("texts", 3000, 2))  # the record holds again
        monkeypatch.setenv("MEMGAS_FAULT", fault)
    bank.compact("texts")
    monkeypatch.delenv("MEMGAS_FAULT", raising=False)
    calls = _counting_reads(monkeypatch)
    got = bank.count("texts")
    assert calls == ["texts"] and got == _oracle_count(bank, "texts")


def test_a_compaction_of_a_table_not_of_ingest_takes_no_count_before_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``embeddings`` ends as one part or two disjoint ones, counted from their metadata: its compaction
    reads no key for a count (a pass over ~6M keys at 10^6 sessions), and the count after it is right."""
    bank = Bank.create(tmp_path / "b")
    bank.write_part("embeddings", "unit-0", _base_rows("embeddings"))
    bank.compact("embeddings")
    bank.write_part("embeddings", "unit-1", _new_rows("embeddings", 1000, 5))
    bank.compact("embeddings")
    bank.update_manifest()
    bank.write_part("embeddings", "unit-2", _new_rows("embeddings", 2000, 3))

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a count before the compaction")

    monkeypatch.setattr(bank_compact.Compacting, "_grown_count", refused)
    bank.compact("embeddings")
    monkeypatch.undo()
    calls = _counting_reads(monkeypatch)
    got = bank.count("embeddings")
    assert calls == [] and got == _oracle_count(bank, "embeddings") == 908
