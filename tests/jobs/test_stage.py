"""jobs/stage.py: the digest of a table's rows (what output digests and fingerprints hash)."""

from __future__ import annotations

import hashlib

import pyarrow as pa

from memgas.jobs.stage import table_digest

SCHEMA = pa.schema([("n", pa.int64()), ("s", pa.string()), ("l", pa.list_(pa.string()))])
ROWS = [{"n": i if i % 3 else None, "s": None if i % 4 == 1 else f"t{i}", "l": None if i % 5 == 2 else [f"x{i}"] * (i % 3)}
        for i in range(23)]


def _ipc_digest(table: pa.Table) -> str:
    """The oracle: blake2b of the Arrow IPC stream of a table built afresh from Python rows."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return hashlib.blake2b(sink.getvalue().to_pybytes(), digest_size=8).hexdigest()


def test_the_same_rows_digest_the_same_however_they_were_cut() -> None:
    whole = pa.Table.from_pylist(ROWS, schema=SCHEMA)
    for start, n in ((0, 23), (3, 11), (5, 1), (9, 14), (1, 0)):
        fresh = pa.Table.from_pylist(ROWS[start:start + n], schema=SCHEMA)
        sliced = whole.slice(start, n)
        chunked = pa.concat_tables([whole.slice(start, n // 2), whole.slice(start + n // 2, n - n // 2)])
        assert table_digest(sliced) == table_digest(chunked) == table_digest(fresh) == _ipc_digest(fresh), (start, n)


def test_other_rows_or_another_order_digest_otherwise() -> None:
    a = pa.Table.from_pylist(ROWS, schema=SCHEMA)
    assert table_digest(a) != table_digest(pa.Table.from_pylist(ROWS[::-1], schema=SCHEMA))
    assert table_digest(a.slice(0, 22)) != table_digest(a)
