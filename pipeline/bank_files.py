"""A bank's files on their own: the layout's names, atomic writes, Parquet options, row helpers.

What :mod:`memgas.pipeline.bank` builds on and needs no bank: a file written so that readers see the old
bytes or the new ones, never half (temp file, fsync, rename), the Parquet options of each table, and the
row operations every reader shares (conform to a schema, keep the last row of a key, key order).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memgas.pipeline import faults
from memgas.pipeline.errors import BankError
from memgas.pipeline.hashing import NotARegularFile
from memgas.pipeline.schema import KEYS

MANIFEST = "manifest.json"
#: Tables that ``memgas ingest`` writes (it owns their ``ingest-*`` parts).
INGEST_TABLES: tuple[str, ...] = ("histories", "sessions", "texts", "turns", "pairs", "queries")
INGEST_PREFIX = "ingest-"
#: Compacted parts are named ``all-<16 hex digits of a digest of their bytes>``.
COMPACT_PREFIX = "all-"
_PARQUET_OPTS = dict(compression="zstd", use_dictionary=True, write_statistics=True)
#: tables written otherwise: stored node blocks are float32 bytes and saved IVF indexes faiss's bytes (SQ8
#: codes: zstd saved 12% of a 64 MiB chunk), both read whole by the next run; without zstd and dictionaries
#: a 96 MiB block decodes ~6x faster, and the 1.4 GB index of 10^6 sessions is read at memory speed
_RAW = dict(compression="none", use_dictionary=False, write_statistics=False)
_TABLE_PARQUET_OPTS = {"node_blocks": _RAW, "ivf_index": _RAW, "ivf_delta": _RAW, "card_graph_ivf_index": _RAW,
                       "card_graph_ivf_delta": _RAW}


def parquet_options(name: str | None) -> dict[str, Any]:
    return _TABLE_PARQUET_OPTS.get(name or "", _PARQUET_OPTS)

def _file_mode() -> int:
    """0666 less the process umask: the mode ``open()`` would give (mkstemp gives 0600)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


_MODE = _file_mode()


def mkstemp_beside(path: Path) -> tuple[int, str]:
    """A temporary file in ``path``'s folder (made if needed), named ``.<name>.<random>.tmp``, with the bank's
    file mode (``mkstemp`` gives 0600): ``(fd, its path)``, for a write renamed onto ``path`` when complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _MODE)
    except OSError:  # a filesystem without modes: keep what mkstemp gave
        pass
    return fd, tmp


def atomic_write_bytes(path: Path, data: bytes, *, point: str = "bank:write-file") -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half.

    Fault points: ``<point>:before-rename`` (temp file complete, not yet in place).
    """
    fd, tmp = mkstemp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        faults.hit(f"{point}:before-rename")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any, *, sort_keys: bool = True, point: str = "bank:write-json") -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=sort_keys, default=str) + "\n").encode(), point=point)


#: bytes buffered per column chunk by a streamed read (:meth:`Bank.read` with ``batch_rows``): its pages
#: are read as they are decoded, not the whole column chunk first
STREAM_BUFFER = 1 << 20


def _read_streamed(path: Path, columns: list[str] | None, filter: pc.Expression | None, batch_rows: int) -> pa.Table:
    """``pq.read_table(path, columns=columns, filters=filter)``, read ``batch_rows`` rows at a time with
    buffered page reads: memory is about one row group (a nested column is decoded a row group at a
    time) and the rows kept, not the file."""
    # no pre-buffering: it reads every row group's column chunks ahead (the whole file, for a small file)
    f = pq.ParquetFile(path, pre_buffer=False, buffer_size=STREAM_BUFFER)
    schema = f.schema_arrow if columns is None else pa.schema([f.schema_arrow.field(c) for c in columns])
    kept = []
    for batch in f.iter_batches(batch_size=batch_rows, columns=columns, use_threads=False):
        t = pa.Table.from_batches([batch], schema)
        kept.append(t.filter(filter) if filter is not None else t)
    return pa.concat_tables(kept) if kept else schema.empty_table()


def _sweep_temps(d: Path, prefix: str) -> None:
    """Remove temp files ``<prefix>*.tmp`` in ``d``: left by a writer killed before its rename."""
    if d.is_dir():
        for f in d.glob(f"{prefix}*.tmp"):
            f.unlink(missing_ok=True)


def _file_digest(path: str | Path) -> str:
    h = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _reason(exc: BaseException) -> str:
    """The first line of why a part could not be read (a part that is not a regular file: which kind)."""
    if isinstance(exc, NotARegularFile):
        return str(exc.strerror)
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def conform(table: pa.Table, schema: pa.Schema, name: str) -> pa.Table:
    """Select and cast ``table``'s columns to ``schema`` (clear error when a column is missing)."""
    missing = [f.name for f in schema if f.name not in table.column_names]
    if missing:
        raise BankError(f"table {name!r}: missing columns {missing}; expected {schema.names}")
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise BankError(f"table {name!r}: columns do not match the schema: {exc}") from None


def dedupe_last(table: pa.Table, keys: Iterable[str]) -> pa.Table:
    """Keep the last row of every key (rows later in ``table`` win), preserving first-seen order."""
    keys = list(keys)
    if table.num_rows == 0:
        return table
    idx = pa.array(range(table.num_rows), pa.int64())
    grouped = table.select(keys).append_column("__i", idx).group_by(keys, use_threads=False)
    last = grouped.aggregate([("__i", "max")]).column("__i_max")
    if len(last) == table.num_rows:
        return table
    return table.take(pc.take(last, pc.sort_indices(last)))


def key_order(name: str, table: pa.Table) -> pa.Table:
    """``table`` in its key order (:data:`memgas.pipeline.schema.KEYS`): one row order whatever order the
    rows were computed in (compaction; every results table's parts)."""
    keys = KEYS.get(name)
    return table.sort_by([(k, "ascending") for k in keys]) if keys and table.num_rows > 1 else table

