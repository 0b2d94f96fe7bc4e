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


# -- values_digest: rows streamed in chunks ------------------------------------------------------------------
FLAT = pa.schema([("n", pa.int32()), ("s", pa.string()), ("b", pa.bool_()), ("f", pa.float64())])
FLAT_ROWS = [{"n": i if i % 3 else None, "s": None if i % 4 == 1 else f"t{i}" * (i % 3), "b": i % 2 == 0,
              "f": i / 7} for i in range(23)]


def _values_oracle(table: pa.Table, chunk: int) -> str:
    """The definition written out over Python values: per chunk and column, the null mask, then the values
    (strings: int64 UTF-8 lengths and the bytes; numbers little-endian, nulls as zero)."""
    import struct

    h = hashlib.blake2b(digest_size=8)
    rows = table.to_pylist()
    for a in range(0, len(rows), chunk):
        part = rows[a:a + chunk]
        for field in table.schema:
            vals = [r[field.name] for r in part]
            h.update(bytes(v is None for v in vals))
            if pa.types.is_string(field.type):
                enc = [(v or "").encode() for v in vals]
                h.update(b"".join(struct.pack("<q", len(e)) for e in enc) + b"".join(enc))
            else:
                fmt = {"int32": "<i", "bool": "<?", "double": "<d"}[str(field.type)]
                h.update(b"".join(struct.pack(fmt, v or 0) for v in vals))
    return h.hexdigest()


def test_values_digest_follows_its_definition_whatever_the_layout() -> None:
    from memgas.jobs.stage import values_digest

    whole = pa.Table.from_pylist(FLAT_ROWS, schema=FLAT)
    for chunk in (23, 7, 1):
        cuts = [whole.slice(a, chunk) for a in range(0, 23, chunk)]
        rechunked = [pa.concat_tables([c.slice(0, 1), c.slice(1)]) for c in cuts]
        fresh = [pa.Table.from_pylist(FLAT_ROWS[a:a + chunk], schema=FLAT) for a in range(0, 23, chunk)]
        assert values_digest(cuts) == values_digest(rechunked) == values_digest(fresh) == _values_oracle(whole, chunk)


def test_values_digest_tells_apart_what_a_separator_would_not() -> None:
    from memgas.jobs.stage import values_digest

    def d(strings: list) -> str:
        return values_digest([pa.table({"s": pa.array(strings, pa.string())})])

    assert d(["a", "bc"]) != d(["ab", "c"]) and d([None]) != d([""]) and d(["a\0b"]) != d(["a", "b"])
