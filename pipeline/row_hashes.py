"""Per-row hashes of a content table's parts, kept beside the bank, and the order-free digest of a selection
of rows they give.

What a content stage committed (``jobs/tables.py: output_digest``) is the digest of the rows its config
selects out of a shared, content-addressed table (the vectors of its texts out of ``embeddings``; its
generations). A hash of those rows in key order had to read them all again after every run of the stage: at
10^6 sessions the ~5M vectors of ``embeddings`` (9 GB) for an append of 1,000 sessions (99 s of a 10-min
append). Here the digest is a *sum* of per-row hashes, which no order enters:

- each row's hash (blake2b, 16 bytes) is of its values alone (:func:`row_hashes`), so a row hashes alike
  whichever part holds it, and an append gives the digest of a fresh build of the same rows;
- a part's row hashes are computed once and cached under ``<bank>/_row_hashes/<table>/`` by the part's
  recorded digest (a part's bytes never change: a compaction writes a new part), so a run reads the key
  columns and hashes of every part, not its vectors;
- the digest of a selection (:func:`summed_digest`) is the count of its rows and the exact sums of the four
  32-bit lanes of their hashes (no wrap-around below 2^32 rows), hashed once more.

A sum is not a cryptographic commitment (rows could be built to cancel out); it only has to tell apart the
rows a config's runs committed, as the ordered hash did. Cached files are checked against the part (its
digest and row count) and recomputed when they do not match or cannot be read.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from memgas.pipeline.bank import Bank
from memgas.pipeline.bank_files import _sweep_temps, dedupe_last, mkstemp_beside
from memgas.pipeline.errors import BankError
from memgas.pipeline.schema import KEYS, schema_for

#: the folder of the cached row hashes, inside the bank (not a table: it has no ``_done``)
ROW_HASH_DIR = "_row_hashes"
#: the row serialisation's name (in each cached file's metadata: a file of another is recomputed)
ROW_FORMAT = "row-hash-1"
#: rows hashed per batch of a part
HASH_BATCH_ROWS = 8192
#: a selection's rows: a boolean mask over a table of key columns
Selector = Callable[[pa.Table], pa.Array]


def row_hashes(t: pa.Table, columns: pa.Schema) -> np.ndarray:
    """uint8 ``[rows, 16]``: blake2b of each row's values in ``columns`` (a column ``t`` lacks is null, of
    the schema's type; a column of ``t`` is taken as the schema's type). A row
    is serialised as its string columns (in ``columns`` order; a null flag, the UTF-8 length as 8 bytes and
    the bytes), then its other columns (a null flag and the value little-endian: fixed-size lists by their
    values, booleans as one byte; zero where null). The bytes depend on the values alone, not on how Arrow
    laid them out (one contiguous matrix of the fixed-width columns, so a row is two slices)."""
    n = t.num_rows
    strings: list[list[bytes]] = []
    fixed: list[np.ndarray] = []
    for field in columns:
        kind = field.type
        col = t[field.name].combine_chunks().cast(kind) if field.name in t.column_names else pa.nulls(n, kind)
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            strings.append([_string_bytes(v) for v in col.to_pylist()])
            continue
        fixed.append(col.is_null().to_numpy(zero_copy_only=False).astype(np.uint8).reshape(n, 1))
        if pa.types.is_fixed_size_list(kind):
            values = pc.fill_null(col, pa.scalar([0] * kind.list_size, kind)).flatten().to_numpy(zero_copy_only=False)
            dtype = np.dtype(kind.value_type.to_pandas_dtype()).newbyteorder("<")
            fixed.append(np.ascontiguousarray(values.astype(dtype)).view(np.uint8).reshape(n, -1))
        elif pa.types.is_boolean(kind) or pa.types.is_integer(kind) or pa.types.is_floating(kind):
            filled = pc.fill_null(col, False if pa.types.is_boolean(kind) else 0).to_numpy(zero_copy_only=False)
            dtype = np.dtype(np.uint8) if pa.types.is_boolean(kind) else \
                np.dtype(kind.to_pandas_dtype()).newbyteorder("<")
            fixed.append(np.ascontiguousarray(filled.astype(dtype)).view(np.uint8).reshape(n, -1))
        else:
            raise TypeError(f"row_hashes: column {field.name!r} of type {kind} has no serialisation")
    matrix = np.ascontiguousarray(np.hstack(fixed)) if fixed else np.zeros((n, 0), np.uint8)
    joined = [b"".join(parts) for parts in zip(*strings)] if strings else [b""] * n
    out = np.empty((n, 16), np.uint8)
    blake = hashlib.blake2b
    # one call per row: hashlib has no batched form; ~3 us a row with a 1.5 KB vector, paid once per part
    for i in range(n):
        out[i] = np.frombuffer(blake(joined[i] + matrix[i].tobytes(), digest_size=16).digest(), np.uint8)
    return out


def _string_bytes(v: str | None) -> bytes:
    if v is None:
        return b"\0"
    b = v.encode("utf-8", "surrogatepass")
    return b"\1" + len(b).to_bytes(8, "little") + b


class RowHashes:
    """The cached row hashes of one bank table's parts (``columns``: what a row's hash covers, in order)."""

    def __init__(self, bank: Bank, name: str, columns: list[str]) -> None:
        self.bank, self.name, self.columns = bank, name, list(columns)
        self.keys = list(KEYS[name])
        self.dir = bank.path / ROW_HASH_DIR / name

    def _path(self, part: str, digest: str) -> Path:
        return self.dir / f"{part}.{digest}.parquet"

    def part(self, part: str) -> pa.Table:
        """The key columns of part ``part`` and ``hash`` (16 bytes a row), in the part's row order: cached,
        else computed from the part (whose bytes are verified first) and cached."""
        digest = self.bank.part_digest(self.name, part)
        if digest is None:
            raise BankError(f"{self.bank.path}: part {self.name}/{part} is gone")
        rows = self.bank.part_rows(self.name, part)
        path = self._path(part, digest)
        cached = self._load(path, digest, rows)
        if cached is not None:
            return cached
        if not self.bank.verify_part(self.name, part):
            raise BankError(f"{self.bank.path}: part {self.name}/{part} is not the one written (its bytes "
                            "changed); delete it and re-run the stage that wrote it")
        table = self._compute(part)
        self._store(path, table, digest)
        return table

    def _load(self, path: Path, digest: str, rows: int) -> pa.Table | None:
        try:
            f = pq.ParquetFile(path)
            meta = json.loads((f.schema_arrow.metadata or {}).get(b"memgas", b"{}"))
            if meta != {"format": ROW_FORMAT, "digest": digest, "columns": self.columns} or f.metadata.num_rows != rows:
                return None
            return f.read()
        except (OSError, pa.ArrowException, ValueError):
            return None  # absent, cut short or another layout: computed again

    def _compute(self, part: str) -> pa.Table:
        on_disk = pq.read_schema(self.bank.path / self.name / f"{part}.parquet")
        dim = getattr(on_disk.field("vector").type, "list_size", None) if "vector" in on_disk.names else None
        schema = schema_for(self.name, dim)
        columns = pa.schema([schema.field(c) for c in self.columns])
        read = [c for c in dict.fromkeys([*self.keys, *self.columns]) if c in on_disk.names]
        pieces = []
        for batch in self.bank.iter_read(self.name, read, batch_rows=HASH_BATCH_ROWS, parts=[part]):
            h = row_hashes(batch, columns)
            pieces.append(batch.select(self.keys).append_column(
                "hash", pa.Array.from_buffers(pa.binary(16), len(h), [None, pa.py_buffer(h.tobytes())])))
        if not pieces:
            keys = pa.schema([pa.field(k, pa.string()) for k in self.keys])
            return keys.empty_table().append_column("hash", pa.array([], pa.binary(16)))
        return pa.concat_tables(pieces).combine_chunks()

    def _store(self, path: Path, table: pa.Table, digest: str) -> None:
        """Written whole or not at all (a temporary file renamed); the files of parts gone are removed. A bank
        this process may not write is hashed again next time."""
        meta = json.dumps({"format": ROW_FORMAT, "digest": digest, "columns": self.columns}).encode()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = mkstemp_beside(path)
            os.close(fd)
            try:
                pq.write_table(table.replace_schema_metadata({b"memgas": meta}), tmp, compression="zstd")
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
            self.sweep()
        except OSError:
            return

    def sweep(self) -> None:
        """Remove the cached files of parts the table no longer holds (or holds with other bytes), and the
        temporary files of writes that were killed (another process's write in flight loses its file and
        stores nothing: a cache)."""
        live = {f"{p}.{self.bank.part_digest(self.name, p)}.parquet" for p in self.bank.parts(self.name)}
        for f in self.dir.glob("*.parquet"):
            if f.name not in live:
                f.unlink(missing_ok=True)
        _sweep_temps(self.dir, ".")


def summed_digest(bank: Bank, name: str, columns: list[str], select: Selector) -> str:
    """The digest of the rows of table ``name`` that ``select`` picks (given a table of its key columns),
    the last written of each key, over ``columns``: the count and lane sums of their :func:`row_hashes`.
    Reads the cached hashes of every part (computing those missing), never the rows themselves again."""
    rh = RowHashes(bank, name, columns)
    parts = bank.parts(name) if bank.exists(name) else []
    hashed = [rh.part(p) for p in parts]
    if not hashed:
        return _digest(0, np.zeros(4, np.uint64))
    t = pa.concat_tables([h.append_column("__part", pa.array(np.full(h.num_rows, i, np.int64)))
                          for i, h in enumerate(hashed)])
    # one call for every part: a selector's membership test builds its value set once (~5M hashes at 10^6
    # sessions: ~1.5 s a build)
    t = t.filter(select(t.select(rh.keys)))
    if len(hashed) > 1 and not bank.disjoint(name, parts):
        t = dedupe_last(t, rh.keys)  # rows later in part order win, as Bank.read keeps them
    h = t["hash"].combine_chunks()
    lanes = np.frombuffer(h.buffers()[1], "<u4", count=4 * len(h), offset=h.offset * 16).reshape(-1, 4) \
        if len(h) else np.zeros((0, 4), np.uint32)
    return _digest(len(h), lanes.sum(axis=0, dtype=np.uint64))


def _digest(rows: int, sums: np.ndarray) -> str:
    payload = json.dumps([ROW_FORMAT, rows, [int(s) for s in sums]]).encode()
    return hashlib.blake2b(payload, digest_size=8).hexdigest()
