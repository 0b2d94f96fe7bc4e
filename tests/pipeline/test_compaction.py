"""Compaction in bounded memory (memgas.pipeline.compaction, Bank.compact).

The oracle is the in-memory compaction it replaced, written out here: every part read whole, concatenated in
part order, the last row of each key kept (``dedupe_last``), sorted by key (``key_order``), written in one
go. The streamed merge must give the same bytes, whatever its batch sizes, with parts out of key order,
keys repeated inside and across parts, null and non-ASCII keys, keys of several columns and parts of an
older layout (a column missing).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from memgas.pipeline import compaction
from memgas.pipeline.bank import Bank, COMPACT_PREFIX, dedupe_last, row_group_rows
from memgas.pipeline.errors import BankError
from memgas.pipeline.hashing import text_hash
from memgas.pipeline.ingest import ingest
from memgas.pipeline.schema import KEYS, schema_for

DIM = 4
SAMPLE3 = Path(__file__).resolve().parents[2] / "data" / "sample" / "longmemeval_s_sample3.json"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _oracle_bytes(bank: Bank, name: str, parts: list[str], tmp: Path, dim: int | None = None) -> str:
    """The compaction of before, kept as the reference: whole parts, dedupe_last, sorted, one write."""
    tables = [pq.read_table(bank.path / name / f"{p}.parquet") for p in parts]
    t = pa.concat_tables(tables, promote_options="permissive")
    t = dedupe_last(t, KEYS[name])
    t = t.sort_by([(k, "ascending") for k in KEYS[name]])
    schema = schema_for(name, dim)
    t = t.select(schema.names).cast(schema).combine_chunks()
    out = tmp / "oracle.parquet"
    pq.write_table(t, out, compression="zstd", use_dictionary=True, write_statistics=True,
                   row_group_size=row_group_rows(name))
    return _sha(out)


def _embeddings(hashes: list[str], seed: int, encoder: str = "enc") -> pa.Table:
    vecs = np.random.default_rng(seed).standard_normal((len(hashes), DIM)).astype(np.float32)
    return pa.table({
        "text_hash": pa.array(hashes, pa.string()),
        "encoder": pa.array([encoder] * len(hashes), pa.string()),
        "vector": pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel()), DIM),
        "truncated": pa.array([False] * len(hashes)),
        "tokens": pa.array(np.arange(len(hashes), dtype=np.int32) + seed),
        "tokens_dropped": pa.array(np.zeros(len(hashes), np.int32)),
    })


def _write_raw(bank: Bank, name: str, part: str, table: pa.Table) -> None:
    """A part as it lies on disk, in the order given (write_part keeps the order it is handed)."""
    bank.write_part(name, part, table)


def _hashes(rng: np.random.Generator, n: int, pool: int) -> list[str]:
    return [f"{x:08x}" for x in rng.integers(0, pool, n)]


def _compacted_bytes(bank: Bank, name: str) -> str:
    (part,) = [p for p in bank.parts(name) if p.startswith(COMPACT_PREFIX)]
    return _sha(bank.path / name / f"{part}.parquet")


@pytest.mark.parametrize(("budget", "fan_in"), [(1, 32), (3_000, 32), (compaction.MERGE_BUDGET_BYTES, 32),
                                                (3_000, 2), (1, 4)])
def test_streamed_compaction_equals_the_in_memory_one(tmp_path: Path, budget: int, fan_in: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Sorted parts, unsorted parts, keys repeated within and across parts, two encoders (a two-column
    key): the same bytes as the oracle for a one-row budget, a small one and the default, merged at once
    or in levels of 2 and 4 runs."""
    rng = np.random.default_rng(7)
    bank = Bank.create(tmp_path / "bank")
    parts = []
    for i in range(6):
        hashes = _hashes(rng, 3_000, 5_000)
        t = _embeddings(hashes, seed=i, encoder=("enc", "alt")[i % 2])
        if i % 3 != 2:  # most parts in key order, as the executor writes them; the rest as they came
            t = t.sort_by([("text_hash", "ascending"), ("encoder", "ascending")])
        part = f"unit-{i:02d}"
        _write_raw(bank, "embeddings", part, t)
        parts.append(part)
    expected = _oracle_bytes(bank, "embeddings", parts, tmp_path, DIM)
    monkeypatch.setattr(compaction, "MERGE_BUDGET_BYTES", budget)
    monkeypatch.setattr(compaction, "MAX_FAN_IN", fan_in)
    rows = bank.compact("embeddings")
    assert _compacted_bytes(bank, "embeddings") == expected
    assert rows == bank.count("embeddings")
    assert not list((bank.path / "embeddings").glob(".compact-runs-*"))  # the sorted copies are gone


def test_row_groups_of_the_table_and_a_later_row_winning_inside_one_part(tmp_path: Path) -> None:
    """More rows than one row group of ``embeddings``; a key written twice inside one unsorted part: the later
    row wins, as it did."""
    bank = Bank.create(tmp_path / "bank")
    n = row_group_rows("embeddings") * 2 + 17
    hashes = [f"{i:07d}" for i in range(n)]
    _write_raw(bank, "embeddings", "unit-a", _embeddings(hashes[::-1], seed=1))
    twice = _embeddings(["0000005", "0000001", "0000005"], seed=2)
    _write_raw(bank, "embeddings", "unit-b", twice)
    expected = _oracle_bytes(bank, "embeddings", ["unit-a", "unit-b"], tmp_path, DIM)
    bank.compact("embeddings")
    assert _compacted_bytes(bank, "embeddings") == expected
    got = bank.read("embeddings").to_pydict()
    i = got["text_hash"].index("0000005")
    assert got["tokens"][i] == 2 + 2  # the third row of unit-b (tokens = row + seed)
    assert pq.ParquetFile(next((bank.path / "embeddings").glob("all-*.parquet"))).metadata.num_row_groups == 3


def test_generations_keys_of_four_columns_with_non_ascii_and_an_older_part(tmp_path: Path) -> None:
    """``generations``: a key of four string columns, non-ASCII values (Arrow orders UTF-8 bytes, Python
    code points: the same order), and a part of an older layout without a nullable column."""
    bank = Bank.create(tmp_path / "bank")
    schema = schema_for("generations")
    rng = np.random.default_rng(3)
    words = ["é", "z", "ä", "a", "日本", "Z", "😀", "ab", "a\u0301"]
    parts = []
    for i in range(4):
        n = 200
        cols = {}
        for f in schema:
            if f.name in KEYS["generations"]:
                cols[f.name] = pa.array([words[j] for j in rng.integers(0, len(words), n)], pa.string())
            elif pa.types.is_string(f.type):
                cols[f.name] = pa.array([f"text {i} {j}" for j in range(n)], pa.string())
            else:
                cols[f.name] = pa.array(np.zeros(n), pa.float64()).cast(f.type, safe=False)
        t = pa.table(cols)
        part = f"unit-{i}"
        bank.write_part("generations", part, t)
        parts.append(part)
    expected = _oracle_bytes(bank, "generations", parts, tmp_path)
    bank.compact("generations")
    assert _compacted_bytes(bank, "generations") == expected


def test_null_keys_sort_last_and_match_the_oracle(tmp_path: Path) -> None:
    """A key column that holds nulls (a damaged or foreign part): ordered last, as Arrow's sort puts them."""
    a = tmp_path / "a.parquet"
    b = tmp_path / "b.parquet"
    pq.write_table(pa.table({"k": ["b", None, "a", None], "v": [1, 2, 3, 4]}), a)
    pq.write_table(pa.table({"k": [None, "a", "c"], "v": [5, 6, 7]}), b)
    (tmp_path / "s").mkdir()
    groups = list(compaction.regroup(compaction.merged([a, b], ["k"], scratch=tmp_path / "s", budget_bytes=1), 2))
    got = pa.concat_tables(groups).to_pydict()
    assert got == {"k": ["a", "b", "c", None], "v": [6, 1, 7, 5]}
    assert [g.num_rows for g in groups] == [2, 2]


def test_texts_rows_held_by_ingest_parts_are_not_written_again(tmp_path: Path) -> None:
    """As Bank.write: a derived text that ingest's own parts hold already stays out of the compacted part."""
    ingest(SAMPLE3, "longmemeval", tmp_path / "b", progress=False)
    bank = Bank(tmp_path / "b")
    ingested = bank.read("texts", ["text_hash", "text"])
    held = pa.table({"text_hash": ingested.column("text_hash").slice(0, 2), "text": ingested.column("text").slice(0, 2)})

    def texts(words: list[str]) -> pa.Table:
        return pa.table({"text_hash": [text_hash(w) for w in words], "text": words})

    bank.write_part("texts", "derived-1", pa.concat_tables([texts(["a summary", "keywords; k"]), held.slice(0, 1)]))
    bank.write_part("texts", "derived-2", pa.concat_tables([held.slice(1, 1), texts(["another summary"])]))
    assert bank.compact("texts") == 3
    (part,) = [p for p in bank.parts("texts") if p.startswith(COMPACT_PREFIX)]
    got = pq.read_table(bank.path / "texts" / f"{part}.parquet").column("text_hash").to_pylist()
    assert got == sorted(text_hash(w) for w in ["a summary", "keywords; k", "another summary"])
    assert bank.count("texts") == ingested.num_rows + 3


def test_an_unreadable_part_is_named_and_nothing_is_dropped(tmp_path: Path) -> None:
    bank = Bank.create(tmp_path / "bank")
    bank.write_part("embeddings", "unit-1", _embeddings(["a", "b"], seed=1))
    bank.write_part("embeddings", "unit-2", _embeddings(["c"], seed=2))
    path = bank.path / "embeddings" / "unit-2.parquet"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-20].ljust(size, b"\0"))  # its footer gone, its size kept
    with pytest.raises(BankError, match=r"unit-2\.parquet: unreadable Parquet part"):
        bank.compact("embeddings")
    assert sorted(bank.parts("embeddings")) == ["unit-1", "unit-2"]
    assert not [f for f in (bank.path / "embeddings").iterdir() if f.name.startswith((".compact", "all-"))]
    # cut short: not a complete part (its marker records another size), so compaction passes it by and leaves
    # its file as it is; its rows are the encoder's to write again
    path.write_bytes(path.read_bytes()[:-20])
    assert bank.parts("embeddings") == ["unit-1"] and bank.compact("embeddings") == 2
    assert path.stat().st_size == size - 20


_MEMORY_CHILD = r"""
import json, resource, sys
from memgas.pipeline import compaction
from memgas.pipeline.bank import Bank
compaction.MERGE_BUDGET_BYTES, compaction.MAX_FAN_IN = 8 << 20, 8
bank = Bank(sys.argv[1])
bank.parts("embeddings")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rows = bank.compact("embeddings")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"rows": rows, "grew_mib": (after - before) / 1024, "before_mib": before / 1024}))
"""


def _vector_parts(bank: Bank, parts: int, rows: int, dim: int = 384) -> float:
    """``parts`` parts of ``rows`` random vectors each, every fourth out of key order; returns the MiB of
    vectors."""
    rng = np.random.default_rng(parts)
    for i in range(parts):
        hashes = [f"{x:016x}" for x in rng.integers(0, 2**62, rows)]
        vecs = rng.standard_normal((rows, dim)).astype(np.float32)
        t = pa.table({
            "text_hash": pa.array(hashes), "encoder": pa.array(["enc"] * rows),
            "vector": pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel()), dim),
            "truncated": pa.array([False] * rows), "tokens": pa.array(np.ones(rows, np.int32)),
            "tokens_dropped": pa.array(np.zeros(rows, np.int32))})
        if i % 4 != 3:
            t = t.sort_by([("text_hash", "ascending")])
        bank.write_part("embeddings", f"unit-{i:03d}", t)
    return parts * rows * dim * 4 / 2**20


def _compaction_growth(bank: Bank) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    # through a small interpreter: on Linux a child's ru_maxrss starts at its parent's (fork, then exec), and
    # the test process's would hide the compaction's
    lean = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", lean, sys.executable, "-c", _MEMORY_CHILD, str(bank.path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_compaction_memory_does_not_grow_with_the_table(tmp_path: Path) -> None:
    """The compacting process's growth (ru_maxrss, in a child of a small interpreter) is about the same for a
    table four times the size, and under twice the larger table. Measured on 2026-12-04: 284 and 237 MiB
    for 47 and 188 MiB of vectors (the merge's budget 8 MiB, 8 runs at once, so the larger table goes
    through a level of scratch files); the compaction before grew by 280 and 739 MiB, and fails both
    bounds. What stays: a floor of ~0.25 GiB of the Parquet writer and the allocator, one decoded row
    group per run, one part sorted, one output row group."""
    small, large = Bank.create(tmp_path / "small"), Bank.create(tmp_path / "large")
    small_mib, large_mib = _vector_parts(small, 8, 4_000), _vector_parts(large, 32, 4_000)
    got_small, got_large = _compaction_growth(small), _compaction_growth(large)
    assert (got_small["rows"], got_large["rows"]) == (8 * 4_000, 32 * 4_000)
    assert large_mib == 4 * small_mib > 180
    assert got_large["before_mib"] < 400, got_large  # the child's own start, not the test process's
    assert got_large["grew_mib"] < 2 * large_mib, (got_small, got_large, large_mib)
    assert got_large["grew_mib"] < got_small["grew_mib"] + 60, (got_small, got_large, large_mib)


def test_a_kill_in_the_middle_of_the_merge_leaves_scratch_that_the_next_compaction_deletes(tmp_path: Path) -> None:
    """SIGKILL after the first row group (fault point bank:compact:merging), with a part out of key order:
    the temp file and the sorted copy stay, the parts are intact; the next compaction (another process)
    deletes them and writes the bytes of an uninterrupted one."""
    import signal

    def build(path: Path) -> Bank:
        bank = Bank.create(path)
        n = row_group_rows("embeddings") + 10
        bank.write_part("embeddings", "unit-a", _embeddings([f"{i:07d}" for i in range(n)][::-1], seed=1))
        bank.write_part("embeddings", "unit-b", _embeddings([f"{i:07d}" for i in range(0, n, 3)], seed=2))
        return bank

    clean = build(tmp_path / "clean")
    clean.compact("embeddings")
    bank = build(tmp_path / "b")
    before = bank.read("embeddings")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MEMGAS_FAULT": "kill@bank:compact:merging"}
    code = f"from memgas.pipeline.bank import Bank; Bank({str(bank.path)!r}).compact('embeddings')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    left = sorted(f.name.split("-")[1] if f.is_dir() else f.suffix for f in (bank.path / "embeddings").iterdir()
                  if f.name.startswith("."))
    assert left == [".tmp", "runs"]  # the temp file and the scratch of sorted copies
    assert Bank(bank.path).read("embeddings").equals(before)
    proc = subprocess.run([sys.executable, "-c", code], env={**env, "MEMGAS_FAULT": ""}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not [f for f in (bank.path / "embeddings").iterdir() if f.name.startswith(".")]
    assert _compacted_bytes(Bank(bank.path), "embeddings") == _compacted_bytes(clean, "embeddings")


def test_parts_with_a_column_of_two_types_get_a_clear_error_and_lose_nothing(tmp_path: Path) -> None:
    """A foreign part whose ``tokens`` are strings: one line that names the table, and the parts stay."""
    bank = Bank.create(tmp_path / "bank")
    bank.write_part("embeddings", "unit-1", _embeddings(["a", "b"], seed=1))
    bad = _embeddings(["c"], seed=2)
    bad = bad.set_column(bad.schema.get_field_index("tokens"), "tokens", pa.array(["many"]))
    pq.write_table(bad, bank.path / "embeddings" / "unit-2.parquet")  # past write_part's schema check
    (bank.path / "embeddings" / "_done" / "unit-2.json").write_text("{}")
    with pytest.raises(BankError, match=r"parts of table 'embeddings' hold a column of different types"):
        bank.compact("embeddings")
    assert sorted(bank.parts("embeddings")) == ["unit-1", "unit-2"]
    assert not [f for f in (bank.path / "embeddings").iterdir() if f.name.startswith((".compact", "all-"))]


# -- tiered: a large compacted part is left alone --------------------------------------------------------------
def _sorted_rows(bank: Bank, name: str) -> pa.Table:
    return bank.read(name).sort_by([(k, "ascending") for k in KEYS[name]])


def test_an_append_merges_only_its_own_parts_beside_a_large_compacted_one(tmp_path: Path) -> None:
    """A compacted part of 900 rows and two unit parts of 50 new keys each: the large part stays (the same
    file), the others become one compacted part, and the table reads as one full merge would give it.
    Appends go on into that second part until it passes an eighth of the large one; then everything is
    merged into one part again, with the bytes of a compaction done at once."""
    bank = Bank.create(tmp_path / "bank")
    bank.write_part("embeddings", "unit-0", _embeddings([f"{i:05d}" for i in range(900)], seed=0))
    bank.compact("embeddings")
    (base,) = bank.parts("embeddings")
    base_bytes = (bank.path / "embeddings" / f"{base}.parquet").read_bytes()
    every = Bank.create(tmp_path / "every")  # the same parts, compacted whole each time (the oracle)
    every.write_part("embeddings", "unit-0", _embeddings([f"{i:05d}" for i in range(900)], seed=0))
    for n in range(1, 4):  # appends of 2 x 25 rows: 50, 100, then 150 > 900 / 8 rows beside the base
        for j in range(2):
            keys = [f"{900 + 50 * (n - 1) + 25 * j + i:05d}" for i in range(25)]
            for b in (bank, every):
                b.write_part("embeddings", f"unit-{n}-{j}", _embeddings(keys[::-1], seed=10 * n + j))
        rows = bank.compact("embeddings")
        assert rows == 900 + 50 * n == bank.count("embeddings")
        expected = _sorted_rows(every, "embeddings")
        assert _sorted_rows(bank, "embeddings").equals(expected)
        parts = bank.parts("embeddings")
        if n < 3:
            assert len(parts) == 2 and base in parts
            assert (bank.path / "embeddings" / f"{base}.parquet").read_bytes() == base_bytes
            assert bank.compact("embeddings") == rows and bank.parts("embeddings") == parts  # nothing to merge
        else:
            every.compact("embeddings")
            assert len(parts) == 1 and base not in parts
            assert _compacted_bytes(bank, "embeddings") == _compacted_bytes(every, "embeddings")


def test_a_key_already_in_the_large_part_merges_everything_and_the_later_row_wins(tmp_path: Path) -> None:
    """A retried row (a key of the compacted part written again with other values): the later row must win,
    which only one merged part can promise, so everything is merged."""
    bank = Bank.create(tmp_path / "bank")
    bank.write_part("embeddings", "unit-0", _embeddings([f"{i:05d}" for i in range(900)], seed=0))
    bank.compact("embeddings")
    retried = _embeddings(["00007", "99999"], seed=5)
    bank.write_part("embeddings", "unit-1", retried)
    bank.compact("embeddings")
    assert len(bank.parts("embeddings")) == 1
    got = bank.read("embeddings").to_pydict()
    i = got["text_hash"].index("00007")
    assert got["tokens"][i] == 5 and got["vector"][i] == retried.column("vector")[0].as_py()


def test_a_kill_while_an_append_is_merged_beside_the_large_part_leaves_it_untouched(tmp_path: Path) -> None:
    """SIGKILL in the middle of the merge of an append's parts (the tiered path): the large part's bytes and
    every row stay; the next compaction finishes with the large part as it was."""
    import signal

    bank = Bank.create(tmp_path / "bank")
    bank.write_part("embeddings", "unit-0", _embeddings([f"{i:05d}" for i in range(900)], seed=0))
    bank.compact("embeddings")
    (base,) = bank.parts("embeddings")
    base_bytes = (bank.path / "embeddings" / f"{base}.parquet").read_bytes()
    bank.write_part("embeddings", "unit-1", _embeddings([f"{i:05d}" for i in range(999, 949, -1)], seed=1))
    before = _sorted_rows(bank, "embeddings")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MEMGAS_FAULT": "kill@bank:compact:merging"}
    code = f"from memgas.pipeline.bank import Bank; Bank({str(bank.path)!r}).compact('embeddings')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert sorted(Bank(bank.path).parts("embeddings")) == sorted([base, "unit-1"])
    assert _sorted_rows(Bank(bank.path), "embeddings").equals(before)
    assert Bank(bank.path).compact("embeddings") == 950
    after = Bank(bank.path)
    assert len(after.parts("embeddings")) == 2 and base in after.parts("embeddings")
    assert (bank.path / "embeddings" / f"{base}.parquet").read_bytes() == base_bytes
    assert _sorted_rows(after, "embeddings").equals(before)
    assert not [f for f in (bank.path / "embeddings").iterdir() if f.name.startswith(".")]
