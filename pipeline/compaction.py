"""A table's parts merged into one, in bounded memory: what :meth:`memgas.pipeline.bank.Bank.compact` writes.

The result is the rows of all the parts, one row per key (the last written wins: later parts, then later
rows of a part), in key order. It is never all in memory: a content table of a 10^6-session history
(``embeddings``: ~8 GB) is merged a batch at a time.

- **Runs.** Each part is a sorted run. Parts written by the executor are in key order already (checked on
  their key columns, which are small); a part that is not (a hand-made part, an older layout) is sorted on
  its own first, into a scratch file beside the table.
- **Merge.** Each run keeps a buffer of its next rows. Every buffered row whose key is below the smallest
  last key of the runs that still have rows to read is final: no run can produce it again. Those rows are
  sorted by (key, run, row) and the last of each key is kept. The runs whose buffers hold nothing final read
  their next batch. A key's rows are therefore always decided together, whatever the batch sizes.
- **Output.** Rows go out in row groups of exactly the table's group size, each column of a group one
  contiguous array: Parquet's pages depend on how the arrays are chunked, so the bytes depend on the rows
  only (:func:`regroup`, which :func:`memgas.pipeline.bank.write_groups` uses for every part the bank writes).

A heap merge in Python would compare row by row; this compares once per batch (a binary search of each
run's buffer) and sorts what is final with Arrow. Memory: the merge's buffers (``budget_bytes`` in all,
estimated from the parts' row sizes) and a decoded row group per run (the fan-in is chosen so that both fit
:data:`MERGE_MEMORY_BYTES`; more parts are merged in levels), one output row group, and the largest part
that is not in key order while it is sorted. Disk: the output, plus sorted copies of the parts not in key
order, plus one level's files while the next is written.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

#: bytes of buffered rows, all runs together (each run reads batches of about budget / (2 x runs))
MERGE_BUDGET_BYTES = 256 << 20
#: rows of one batch, at least and at most, whatever the budget
MIN_BATCH_ROWS, MAX_BATCH_ROWS = 256, 65536
#: memory for the runs merged at once. Each run holds a decoded row group of its file (a nested column, such
#: as ``embeddings``' vectors, is decoded a row group at a time: 8192 rows, ~13 MB at 384 dimensions) and a
#: batch of at least MIN_BATCH_ROWS rows, so the fan-in is what this allows (from the files' metadata); more
#: parts than that are merged in levels, that many consecutive runs into one scratch file each, whose rows
#: then follow in the same write order.
MERGE_MEMORY_BYTES = 1 << 30
#: runs merged at once, at most: each round's work and the batches' count grow with the runs (2,000 parts of
#: 512 rows: 121 s and 1.37 GB at 256 runs, 87.5 s and 0.70 GB at 64, both in two passes; docs/benchmarks.md)
MAX_FAN_IN = 64
#: rows per batch when a part's key columns are checked for key order
CHECK_BATCH_ROWS = 1 << 16

_RUN, _ROW = "__merge_run", "__merge_row"


class PartUnreadable(Exception):
    """Part ``index`` (of the paths given) could not be read: the caller names it and says what to do."""

    def __init__(self, index: int, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.index, self.exc = index, exc


class SchemasDisagree(Exception):
    """The parts' columns cannot be unified (one column of two types)."""


def _key_tuples(table: pa.Table, keys: Sequence[str]) -> list[tuple]:
    """Each row's key as a tuple that Python orders as Arrow's ascending sort does (nulls last). Strings
    compare by code point in Python and by UTF-8 bytes in Arrow: the same order."""
    cols = [table.column(k).to_pylist() for k in keys]
    return [tuple((v is None, v) for v in row) for row in zip(*cols)]


def _sort_keys(keys: Sequence[str]) -> list[tuple[str, str, str]]:
    """(key, run, row) ascending, nulls last: equal keys in write order."""
    return [(k, "ascending", "at_end") for k in [*keys, _RUN, _ROW]]


def in_key_order(path: Path, keys: Sequence[str]) -> bool:
    """Whether the rows of the Parquet file ``path`` are in key order (equal keys allowed), read on the key
    columns only, a batch at a time."""
    f = pq.ParquetFile(path, pre_buffer=False)
    last: tuple | None = None
    for batch in f.iter_batches(batch_size=CHECK_BATCH_ROWS, columns=list(keys), use_threads=False):
        t = pa.Table.from_batches([batch]).append_column(_RUN, pa.array(np.zeros(batch.num_rows, np.int64)))
        t = t.append_column(_ROW, pa.array(np.arange(batch.num_rows, dtype=np.int64)))
        order = pc.sort_indices(t, sort_keys=_sort_keys(keys)).to_numpy()
        if not np.array_equal(order, np.arange(batch.num_rows)):
            return False
        if batch.num_rows:
            first, end = _key_tuples(t.slice(0, 1), keys)[0], _key_tuples(t.slice(batch.num_rows - 1), keys)[0]
            if last is not None and first < last:
                return False
            last = end
    return True


def sort_part(path: Path, keys: Sequence[str], out: Path, group_rows: int) -> None:
    """Write the rows of ``path`` to ``out`` in key order, each row keeping its place in ``path`` (column
    ``__merge_row``) so that the last of equal keys still wins."""
    t = pq.read_table(path)
    t = t.append_column(_ROW, pa.array(np.arange(t.num_rows, dtype=np.int64)))
    t = t.append_column(_RUN, pa.array(np.zeros(t.num_rows, np.int64)))
    t = t.take(pc.sort_indices(t, sort_keys=_sort_keys(keys))).drop_columns([_RUN])
    pq.write_table(t, out, row_group_size=group_rows, compression="zstd")


class _Run:
    """One sorted run, read a batch at a time: ``table[pos:]`` are its buffered rows not yet merged."""

    def __init__(self, index: int, path: Path, schema: pa.Schema, batch_rows: int, part: int | None) -> None:
        """``index``: the run's place in write order; ``part``: the caller's part it reads (for errors), None
        for a file of the merge's own."""
        self.index, self.path, self.schema, self.part = index, path, schema, part
        try:
            f = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
        except (OSError, pa.ArrowException) as exc:
            self._fail(exc)
        self.total, self.read_rows = f.metadata.num_rows, 0
        self.has_rows = _ROW in f.schema_arrow.names  # a sorted copy carries each row's place in its part
        self._batches: Iterator[pa.RecordBatch] = f.iter_batches(batch_size=batch_rows, use_threads=False)
        self.table: pa.Table | None = None
        self.keys: list[tuple] = []
        self.pos = 0

    @property
    def more(self) -> bool:
        """Rows left to read."""
        return self.read_rows < self.total

    @property
    def pending(self) -> int:
        return len(self.keys) - self.pos

    def refill(self, keys: Sequence[str]) -> None:
        """Read the next batch into the buffer (behind the rows not yet merged)."""
        try:
            batch = next(self._batches)
        except StopIteration:  # fewer rows than the metadata said: a damaged file
            self._fail(OSError(f"ended after {self.read_rows} of {self.total} rows"))
        except (OSError, pa.ArrowException) as exc:
            self._fail(exc)
        raw = pa.Table.from_batches([batch])
        rows = raw.column(_ROW) if self.has_rows else \
            pa.array(np.arange(self.read_rows, self.read_rows + raw.num_rows, dtype=np.int64))
        t = _aligned(raw, self.schema).append_column(_ROW, rows)
        t = t.append_column(_RUN, pa.array(np.full(t.num_rows, self.index, np.int64)))
        self.read_rows += batch.num_rows
        new = _key_tuples(t, keys)
        if self.table is None or self.pending == 0:
            self.table, self.keys = t, new
        else:
            self.table = pa.concat_tables([self.table.slice(self.pos), t])
            self.keys = self.keys[self.pos:] + new
        self.pos = 0

    def _fail(self, exc: BaseException) -> None:
        if self.part is None:
            raise exc
        raise PartUnreadable(self.part, exc) from None

    def take_below(self, bound: tuple | None) -> pa.Table | None:
        """The buffered rows whose key is below ``bound`` (all of them when ``bound`` is None)."""
        end = len(self.keys) if bound is None else bisect.bisect_left(self.keys, bound, self.pos)
        if end == self.pos or self.table is None:
            return None
        out = self.table.slice(self.pos, end - self.pos)
        self.pos = end
        return out


def _aligned(t: pa.Table, schema: pa.Schema) -> pa.Table:
    """``t`` with ``schema``'s columns, in its order; a column a part lacks (an older layout) is null."""
    cols = [t.column(f.name) if f.name in t.column_names else pa.nulls(t.num_rows, f.type) for f in schema]
    return pa.table(cols, schema=schema)


def _last_of_each_key(t: pa.Table, keys: Sequence[str]) -> pa.Table:
    """Of rows sorted by (key, run, row), the last row of each key."""
    n = t.num_rows
    if n <= 1:
        return t
    differs = pa.array(np.zeros(n - 1, bool))
    for k in keys:
        col = t.column(k).combine_chunks()
        a, b = col.slice(0, n - 1), col.slice(1)
        same = pc.or_(pc.fill_null(pc.equal(a, b), False), pc.and_(pc.is_null(a), pc.is_null(b)))
        differs = pc.or_(differs, pc.invert(same))
    keep = np.append(differs.to_numpy(zero_copy_only=False), True)
    return t if keep.all() else t.filter(pa.array(keep))


def merged(
    paths: Sequence[Path],
    keys: Sequence[str],
    *,
    scratch: Path,
    budget_bytes: int | None = None,
) -> Iterator[pa.Table]:
    """The rows of the Parquet files ``paths`` (in write order: a later file's row wins over an earlier one's
    of the same key), one per key, in key order, in batches of any size (columns: the files' schemas
    unified). ``budget_bytes``: of all the runs' buffers (default :data:`MERGE_BUDGET_BYTES`).
    ``scratch``: an empty directory for sorted copies of parts that are not in key order and for levels.
    Raises :class:`PartUnreadable` for a file that cannot be read."""
    keys = list(keys)
    budget_bytes = MERGE_BUDGET_BYTES if budget_bytes is None else budget_bytes
    schemas, row_bytes, group_bytes = [], 1, 0
    for i, p in enumerate(paths):
        try:
            f = pq.ParquetFile(p)
            md = f.metadata
            schemas.append(f.schema_arrow)
            for g in range(md.num_row_groups):
                rg = md.row_group(g)
                row_bytes = max(row_bytes, rg.total_byte_size // max(rg.num_rows, 1))
                group_bytes = max(group_bytes, rg.total_byte_size)
        except (OSError, pa.ArrowException) as exc:
            raise PartUnreadable(i, exc) from None
    try:
        schema = pa.unify_schemas(schemas, promote_options="permissive") if schemas else pa.schema([])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise SchemasDisagree(str(exc).splitlines()[0]) from None
    per_run = group_bytes + 2 * MIN_BATCH_ROWS * row_bytes
    fan_in = int(np.clip(min(MERGE_MEMORY_BYTES // per_run, budget_bytes // (2 * MIN_BATCH_ROWS * row_bytes)),
                         2, MAX_FAN_IN))
    runs_at_once = min(max(len(paths), 1), fan_in)
    batch_rows = int(np.clip(budget_bytes // (2 * runs_at_once * row_bytes), MIN_BATCH_ROWS, MAX_BATCH_ROWS))

    sources = []
    for i, p in enumerate(paths):
        try:
            if in_key_order(p, keys):
                sources.append(p)
                continue
            sorted_copy = scratch / f"sorted-{i:05d}.parquet"
            sort_part(p, keys, sorted_copy, batch_rows)
            sources.append(sorted_copy)
        except (OSError, pa.ArrowException) as exc:
            raise PartUnreadable(i, exc) from None
    parts: list[int | None] = list(range(len(sources)))
    level = 0
    while len(sources) > fan_in:  # merge fan_in consecutive runs at a time (write order kept) into one
        level_files = []
        for g in range(0, len(sources), fan_in):
            path = scratch / f"merged-{level}-{g // fan_in:05d}.parquet"
            with pq.ParquetWriter(path, schema, compression="none") as w:
                for t in regroup(_merge(sources[g:g + fan_in], parts[g:g + fan_in], keys, schema, batch_rows),
                                 batch_rows):
                    w.write_table(t)
            level_files.append(path)
        for p in sources:
            if p.parent == scratch:
                p.unlink()
        sources, parts, level = level_files, [None] * len(level_files), level + 1
    yield from _merge(sources, parts, keys, schema, batch_rows)


def _merge(sources: Sequence[Path], parts: Sequence[int | None], keys: list[str], schema: pa.Schema,
           batch_rows: int) -> Iterator[pa.Table]:
    """The merged rows of the sorted runs ``sources`` (in write order)."""
    runs = [_Run(i, p, schema, batch_rows, part) for i, (p, part) in enumerate(zip(sources, parts))]
    columns = schema.names
    while True:
        for r in runs:
            while r.pending == 0 and r.more:
                r.refill(keys)
        live = [r for r in runs if r.pending]
        if not live:
            return
        waiting = [r for r in runs if r.more]
        bound = min(r.keys[-1] for r in waiting) if waiting else None
        pieces = [t for t in (r.take_below(bound) for r in live) if t is not None]
        if not pieces:  # every row buffered ties with the bound: the runs that end on it read further
            for r in waiting:
                if r.keys[-1] == bound:
                    r.refill(keys)
            continue
        t = pa.concat_tables(pieces)
        yield _last_of_each_key(t.take(pc.sort_indices(t, sort_keys=_sort_keys(keys))), keys).select(columns)


def regroup(tables: Iterable[pa.Table], rows: int) -> Iterator[pa.Table]:
    """The rows of ``tables`` in groups of exactly ``rows`` rows (the last fewer, none if empty), each
    column of a group one contiguous array."""
    pieces: list[pa.Table] = []
    buffered = 0
    for t in tables:
        if t.num_rows:
            pieces.append(t)
            buffered += t.num_rows
        while buffered >= rows:
            whole = pa.concat_tables(pieces)
            yield whole.slice(0, rows).combine_chunks()
            rest = whole.slice(rows)
            pieces, buffered = ([rest] if rest.num_rows else []), buffered - rows
    if buffered:
        yield pa.concat_tables(pieces).combine_chunks()


def without_keys(tables: Iterable[pa.Table], key: str, drop: pa.Array | None) -> Iterator[pa.Table]:
    """``tables`` without the rows whose ``key`` is in ``drop``."""
    for t in tables:
        yield t if drop is None or not len(drop) else t.filter(pc.invert(pc.is_in(t.column(key), value_set=drop)))
