"""Row hashes and the order-free digest of a selection (pipeline/row_hashes.py): a row's hash is its values'
(however Arrow laid them out), the digest is that of the rows Bank.read gives (the last written of a key
wins), whichever parts hold them, and an unchanged part is hashed once."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from memgas.pipeline import row_hashes as R
from memgas.pipeline.bank import Bank
from memgas.pipeline.errors import BankError
from memgas.pipeline.schema import KEYS, embeddings_schema, schema_for

DIM = 4
SCHEMA = embeddings_schema(DIM)
COLUMNS = SCHEMA.names


def _rows(keys: list[tuple[str, str]], seed: int, tokens: list[int | None] | None = None) -> pa.Table:
    vec = np.random.default_rng(seed).standard_normal((len(keys), DIM)).astype(np.float32)
    return pa.table({"text_hash": [h for h, _ in keys], "encoder": [k for _, k in keys],
                     "vector": pa.FixedSizeListArray.from_arrays(pa.array(vec.ravel(), pa.float32()), DIM),
                     "truncated": [i % 2 == 0 for i in range(len(keys))],
                     "tokens": tokens if tokens is not None else list(range(len(keys))),
                     "tokens_dropped": [0] * len(keys)}, schema=embeddings_schema(DIM))


def _oracle_row(row: dict) -> bytes:
    """One row's hash by the definition, written out by hand: strings (flag, 8-byte length, UTF-8), then the
    fixed-width columns (flag, little-endian value; zero where null)."""
    out = b""
    for c in ("text_hash", "encoder"):
        b = row[c].encode()
        out += b"\1" + len(b).to_bytes(8, "little") + b
    out += b"\0" + np.asarray(row["vector"], "<f4").tobytes()
    out += b"\0" + bytes([int(row["truncated"])])
    for c in ("tokens", "tokens_dropped"):
        v = row[c]
        out += (b"\1" + b"\0" * 4) if v is None else (b"\0" + int(v).to_bytes(4, "little", signed=True))
    return hashlib.blake2b(out, digest_size=16).digest()


def _oracle_digest(rows: pa.Table) -> str:
    """count and exact lane sums of the rows' hashes, hashed (the module's definition)."""
    lanes = np.zeros(4, object)
    for r in rows.to_pylist():
        lanes += np.frombuffer(_oracle_row(r), "<u4").astype(object)
    payload = f'["{R.ROW_FORMAT}", {rows.num_rows}, [{", ".join(str(int(x)) for x in lanes)}]]'.encode()
    return hashlib.blake2b(payload, digest_size=8).hexdigest()


def _k1(keys: pa.Table) -> pa.Array:
    return pc.equal(keys["encoder"], "k1")


@pytest.fixture()
def bank(tmp_path: Path) -> Bank:
    return Bank.create(tmp_path / "bank")


def test_a_row_hash_is_the_hash_of_its_values_by_the_definition() -> None:
    t = _rows([("a", "k1"), ("bé", "k2"), ("c", "k1")], 0, tokens=[3, None, 5])
    got = R.row_hashes(t, SCHEMA)
    assert [bytes(r) for r in got] == [_oracle_row(r) for r in t.to_pylist()]


def test_a_row_hash_does_not_depend_on_arrow_layout_or_on_which_rows_are_beside_it() -> None:
    t = _rows([(f"h{i}", "k1") for i in range(10)], 1)
    whole = R.row_hashes(t, SCHEMA)
    chunked = pa.concat_tables([t.slice(0, 3), t.slice(3, 4), t.slice(7)])
    assert np.array_equal(R.row_hashes(chunked, SCHEMA), whole)
    assert np.array_equal(R.row_hashes(t.slice(4, 3), SCHEMA), whole[4:7])
    # a column the rows lack counts as null, as a null column does
    nulls = t.set_column(t.schema.get_field_index("tokens"), "tokens", pa.nulls(10, pa.int32()))
    assert np.array_equal(R.row_hashes(t.drop_columns(["tokens"]), SCHEMA), R.row_hashes(nulls, SCHEMA))
    assert not np.array_equal(R.row_hashes(nulls, SCHEMA), whole)


def test_the_digest_is_that_of_the_rows_bank_read_gives_whichever_parts_hold_them(tmp_path: Path) -> None:
    keys = [(f"h{i:03d}", k) for i in range(40) for k in ("k1", "k2")]
    rows = _rows(keys, 2)
    one = Bank.create(tmp_path / "one")
    one.write_part("embeddings", "a", rows)
    two = Bank.create(tmp_path / "two")  # the same rows in three parts, in another order
    two.write_part("embeddings", "a", rows.slice(50))
    two.write_part("embeddings", "b", rows.slice(0, 20).take(pa.array(range(19, -1, -1))))
    two.write_part("embeddings", "c", rows.slice(20, 30))
    mine = rows.filter(_k1(rows))
    want = _oracle_digest(mine)
    assert R.summed_digest(one, "embeddings", COLUMNS, _k1) == want
    assert R.summed_digest(two, "embeddings", COLUMNS, _k1) == want
    assert R.summed_digest(one, "embeddings", COLUMNS, lambda k: pc.equal(k["encoder"], "k3")) == \
        _oracle_digest(mine.slice(0, 0))
    # a later part re-writes two rows with other vectors: the later rows are the ones digested
    later = _rows([("h003", "k1"), ("h007", "k1")], 9)
    two.write_part("embeddings", "d", later)
    read = two.read("embeddings").filter(_k1(two.read("embeddings")))
    assert R.summed_digest(two, "embeddings", COLUMNS, _k1) == _oracle_digest(read) != want
    assert read.num_rows == mine.num_rows


def test_an_unchanged_part_is_hashed_once_and_a_part_gone_leaves_no_cache(bank: Bank, monkeypatch) -> None:
    bank.write_part("embeddings", "a", _rows([(f"h{i}", "k1") for i in range(20)], 3))
    first = R.summed_digest(bank, "embeddings", COLUMNS, _k1)
    calls = []
    real = R.row_hashes
    monkeypatch.setattr(R, "row_hashes", lambda t, c: calls.append(t.num_rows) or real(t, c))
    assert R.summed_digest(bank, "embeddings", COLUMNS, _k1) == first and calls == []
    bank.write_part("embeddings", "b", _rows([("x", "k1")], 4))
    R.summed_digest(bank, "embeddings", COLUMNS, _k1)
    assert calls == [1]  # only the new part's row
    cache = bank.path / R.ROW_HASH_DIR / "embeddings"
    assert sorted(p.name.split(".")[0] for p in cache.glob("*.parquet")) == ["a", "b"]
    bank.compact("embeddings")
    compacted = R.summed_digest(bank, "embeddings", COLUMNS, _k1)
    assert [p.name.split(".")[0] for p in cache.glob("*.parquet")] == bank.parts("embeddings")
    assert compacted == _oracle_digest(bank.read("embeddings"))


def test_a_cached_file_that_does_not_match_its_part_is_computed_again(bank: Bank) -> None:
    bank.write_part("embeddings", "a", _rows([(f"h{i}", "k1") for i in range(20)], 5))
    want = R.summed_digest(bank, "embeddings", COLUMNS, _k1)
    (cached,) = (bank.path / R.ROW_HASH_DIR / "embeddings").glob("*.parquet")
    cached.write_bytes(cached.read_bytes()[:100])  # cut short
    assert R.summed_digest(bank, "embeddings", COLUMNS, _k1) == want
    # hashes of other rows under this part's name and digest: refused by their row count
    other = R.RowHashes(bank, "embeddings", COLUMNS)
    bad = pa.table({"text_hash": ["z"], "encoder": ["k1"], "hash": pa.array([b"\0" * 16], pa.binary(16))})
    other._store(cached, bad, bank.part_digest("embeddings", "a"))
    assert R.summed_digest(bank, "embeddings", COLUMNS, _k1) == want


def test_an_altered_part_is_refused_not_hashed(bank: Bank) -> None:
    path = bank.write_part("embeddings", "a", _rows([(f"h{i}", "k1") for i in range(20)], 6))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BankError, match="not the one written|unreadable Parquet part"):
        R.summed_digest(bank, "embeddings", COLUMNS, _k1)


def test_the_generations_key_columns_select(bank: Bank) -> None:
    """A table of four key columns: the selection sees them all."""
    names = schema_for("generations").names
    rows = pa.table({"text_hash": ["s1", "s1", "s2", "s2"], "kind": ["summary", "keywords"] * 2,
                     "model": ["m", "m", "m", "other"], "prompt_version": ["v"] * 4,
                     "output": ["a", "b", "c", "d"], "raw_output": [None, "b!", None, None],
                     "prompt_tokens": [1, 2, None, 4], "completion_tokens": [5, 6, 7, 8],
                     "input_truncated": [False, None, True, False], "fallback": [None] * 4, "error": [None] * 4},
                    schema=schema_for("generations"))
    bank.write_part("generations", "a", rows)
    mine = pc.equal(rows["model"], "m")
    full = bank.read("generations").filter(mine)
    got = R.summed_digest(bank, "generations", names, lambda k: pc.equal(k["model"], "m"))
    assert list(KEYS["generations"]) == R.RowHashes(bank, "generations", names).keys
    assert got == R.summed_digest(bank, "generations", names, lambda k: pc.equal(k["model"], "m"))
    hashes = R.row_hashes(full, schema_for("generations"))
    lanes = hashes.view("<u4").astype(np.uint64).sum(axis=0)
    assert got == R._digest(3, lanes)


def test_two_parts_recorded_disjoint_are_summed_without_de_duplication(bank: Bank, monkeypatch) -> None:
    """Tiered compaction's two parts (the second recorded disjoint from the first): the digest of the rows
    Bank.read gives, with no de-duplication pass."""
    bank.write_part("embeddings", "a", _rows([(f"h{i:03d}", "k1") for i in range(80)], 7))
    bank.compact("embeddings")
    bank.write_part("embeddings", "b", _rows([(f"n{i}", "k1") for i in range(5)], 8))
    bank.compact("embeddings")
    parts = bank.parts("embeddings")
    assert len(parts) == 2 and bank.disjoint("embeddings", parts)
    calls = []
    monkeypatch.setattr(R, "dedupe_last", lambda t, k: calls.append(1) or t)
    assert R.summed_digest(bank, "embeddings", COLUMNS, _k1) == _oracle_digest(bank.read("embeddings")) and not calls


def test_a_killed_write_leaves_no_file_behind_the_next_store(bank: Bank) -> None:
    """A write killed before its rename leaves ``.<name>.<random>.tmp``: never read, and removed by the next
    store."""
    bank.write_part("embeddings", "a", _rows([(f"h{i}", "k1") for i in range(10)], 9))
    cache = bank.path / R.ROW_HASH_DIR / "embeddings"
    cache.mkdir(parents=True)
    (cache / ".a.x.parquet.123.tmp").write_bytes(b"half a file")
    want = R.summed_digest(bank, "embeddings", COLUMNS, _k1)
    assert sorted(p.name.split(".")[0] for p in cache.iterdir()) == ["a"]
    assert R.summed_digest(bank, "embeddings", COLUMNS, _k1) == want


def test_a_full_disk_while_storing_the_hashes_changes_no_digest(bank: Bank, monkeypatch) -> None:
    """No space for the cached hashes: the digest is the same, nothing half-written stays, and the next call
    (space back) stores them."""
    import errno

    bank.write_part("embeddings", "a", _rows([(f"h{i}", "k1") for i in range(10)], 10))
    want = _oracle_digest(bank.read("embeddings"))
    real = R.pq.write_table

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(R.pq, "write_table", full)
    assert R.summed_digest(bank, "embeddings", COLUMNS, _k1) == want
    cache = bank.path / R.ROW_HASH_DIR / "embeddings"
    assert not cache.exists() or not any(cache.iterdir())
    monkeypatch.setattr(R.pq, "write_table", real)
    assert R.summed_digest(bank, "embeddings", COLUMNS, _k1) == want and len(list(cache.glob("*.parquet"))) == 1
