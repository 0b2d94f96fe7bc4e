"""A memory bank: a directory of Parquet tables plus ``manifest.json``.

Layout::

    BANK/
      manifest.json                 schema version, datasets (sha256), committed ingest parts, row counts, ...
      <table>/<part>.parquet        one or more parts per table (see memgas.pipeline.schema)
      <table>/_done/<part>.json     completion marker of a part: written after the part, atomically

Why parts with markers: every job writes its shard as one part, atomically (temp file + rename), and
then its marker. A part without a marker (a kill between the two renames) is ignored by readers and
rewritten by the next run, so a killed job resumes without losing or duplicating rows. Re-writing a
part with the same name replaces it, which is what makes every stage idempotent.

Two commit points make the multi-part operations crash-safe (docs/reliability.md):

- **Compaction** (:meth:`Bank.write`, :meth:`Bank.compact`) writes the merged table as a *new* part
  ``all-<digest of its bytes>``, marks it, and only then drops the parts it replaces. A kill or a full disk
  at any instruction leaves either the old parts (the new one unmarked, ignored) or old and new together,
  which readers merge by key (same rows): the data stays readable throughout.
- **Ingest** writes its parts ``ingest-<slot>-NNNNN`` beside the committed ones (the other of two slots),
  invisible to readers, and commits them by one atomic manifest write that names them
  (``manifest["ingest"]["parts"]``); the old slot is dropped afterwards. The ingest tables are one unit:
  when a committed part is missing (deleted, say, because it was unreadable) :meth:`Bank.exists` says no
  for every ingest table, :meth:`Bank.read` refuses, and the next run re-ingests.

The ingest tables' ``ingest-*`` parts belong to ingest alone: compaction never drops them (``texts`` also
holds derived texts, summaries and keywords; those survive a re-ingest).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memgas import __version__
from memgas.pipeline import faults
from memgas.pipeline.compaction import PartUnreadable, SchemasDisagree, merged, regroup, without_keys
from memgas.pipeline.errors import BankError
from memgas.pipeline.hashing import NotARegularFile, file_digest, file_matches, read_regular_bytes, regular_file_size
from memgas.pipeline.process_dirs import process_directory
from memgas.pipeline.schema import KEYS, SCHEMA_VERSION, VECTOR_TABLES, schema_for

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_PARQUET_OPTS = dict(compression="zstd", use_dictionary=True, write_statistics=True)
#: tables written otherwise: stored node blocks are float32 bytes and saved IVF indexes faiss's bytes (SQ8
#: codes: zstd saved 12% of a 64 MiB chunk), both read whole by the next run; without zstd and dictionaries
#: a 96 MiB block decodes ~6x faster, and the 1.4 GB index of 10^6 sessions is read at memory speed
_RAW = dict(compression="none", use_dictionary=False, write_statistics=False)
_TABLE_PARQUET_OPTS = {"node_blocks": _RAW, "ivf_index": _RAW, "ivf_delta": _RAW}


def parquet_options(name: str | None) -> dict[str, Any]:
    return _TABLE_PARQUET_OPTS.get(name or "", _PARQUET_OPTS)

#: Tables that ``memgas ingest`` writes (it owns their ``ingest-*`` parts).
INGEST_TABLES: tuple[str, ...] = ("histories", "sessions", "texts", "turns", "pairs", "queries")
INGEST_PREFIX = "ingest-"
#: Compacted parts are named ``all-<16 hex digits of a digest of their bytes>``.
COMPACT_PREFIX = "all-"
#: :meth:`Bank.compact` leaves a compacted part alone when it holds this many times the rows of the others
TIER_RATIO = 8
#: scratch directories of a compaction (sorted copies of parts not in key order), beside the table's parts
COMPACT_SCRATCH_PREFIX = ".compact-runs-"


def _file_mode() -> int:
    """0666 less the process umask: the mode ``open()`` would give (mkstemp gives 0600)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


_MODE = _file_mode()


def _mkstemp(path: Path) -> tuple[int, str]:
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
    fd, tmp = _mkstemp(path)
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


#: rows per Parquet row group of a table's parts where the writer's default (1 Mi rows) is too many: a
#: reader decodes a whole row group (nested columns too) even to keep a few rows of it, so a 1 Mi-row group
#: of 384-d vectors would be 1.5 GB in memory. 8,192 vectors are 12 MiB. ``ivf_index``: one row (one chunk
#: of a saved index, jobs/stages/associate.py) a group: Parquet buffers a whole column chunk while it writes
#: and reads one, several times over (a 1.5 GB index in one group took ~5 GB more to write and ~7 GB to
#: read; in groups of 64 MiB, 0.5 and 2 GB). Other tables keep the default.
ROW_GROUP_ROWS = {"embeddings": 8192, "node_blocks": 8192, "ivf_index": 1, "ivf_delta": 1}


#: Parquet's own default (at most 1 Mi rows a row group), stated so that a table written a group at a time
#: gets the groups a whole-table write would
DEFAULT_ROW_GROUP_ROWS = 1 << 20


def row_group_rows(name: str | None) -> int:
    """Rows per row group of a part of table ``name``."""
    return (ROW_GROUP_ROWS.get(name) if name else None) or DEFAULT_ROW_GROUP_ROWS


def write_groups(writer: pq.ParquetWriter, table: pa.Table, rows: int) -> None:
    """Write ``table`` in row groups of ``rows`` rows, each column of a group as one contiguous array.

    Parquet's page boundaries follow how the arrays are chunked, so the same rows in other chunks (a
    concatenation, a sort's ``take``, a merge's batches) would give other bytes; combined per group, the
    bytes depend on the rows only (and equal ``pq.write_table`` of a one-chunk table)."""
    if table.num_rows == 0:
        writer.write_table(table)
    for group in regroup([table], rows):  # the compaction's grouping of a stream, here of one table
        writer.write_table(group, row_group_size=rows)


def _write_parquet(path: str | Path, table: pa.Table, name: str | None) -> None:
    with pq.ParquetWriter(path, table.schema, **parquet_options(name)) as writer:
        write_groups(writer, table, row_group_rows(name))


def atomic_write_parquet(path: Path, table: pa.Table, *, point: str = "bank:write-parquet",
                         table_name: str | None = None) -> None:
    """Write ``table`` to ``path`` atomically (as a part of table ``table_name``: its row groups, see
    :data:`ROW_GROUP_ROWS`). Fault point ``<point>:before-rename``."""
    fd, tmp = _mkstemp(path)
    os.close(fd)
    try:
        _write_parquet(tmp, table, table_name)
        faults.hit(f"{point}:before-rename")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


class Bank:
    """A memory bank directory. ``Bank.create`` makes one; ``Bank(path)`` opens an existing one."""

    def __init__(self, path: str | Path, *, _create: bool = False) -> None:
        self.path = Path(path)
        self._mcache: tuple[tuple[int, int, int], dict[str, Any]] | None = None
        manifest = self.path / MANIFEST
        if _create:
            if self.path.exists() and not self.path.is_dir():
                raise BankError(f"{self.path}: exists and is not a directory")
            self.path.mkdir(parents=True, exist_ok=True)
            if not manifest.exists():
                atomic_write_json(
                    manifest,
                    {
                        "schema_version": SCHEMA_VERSION,
                        "memgas_version": __version__,
                        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "datasets": [],
                        "ingest": {"parts": []},
                        "stages": {},
                        "row_counts": {},
                    },
                    point="bank:manifest",
                )
        if not manifest.is_file():
            what = "no such directory" if not self.path.exists() else (
                "not a directory" if not self.path.is_dir() else f"no {MANIFEST}")
            raise BankError(f"{self.path}: not a memory bank ({what}); create one with `memgas ingest`")
        version = self.manifest.get("schema_version")
        if version != SCHEMA_VERSION:
            raise BankError(
                f"{self.path}: bank schema version {version} but this memgas reads version {SCHEMA_VERSION}; "
                "re-create the bank with `memgas ingest` (or use the memgas release that wrote it)"
            )

    @classmethod
    def create(cls, path: str | Path) -> Bank:
        return cls(path, _create=True)

    # -- manifest -----------------------------------------------------------------------------
    @property
    def manifest(self) -> dict[str, Any]:
        """The manifest (a fresh copy; re-read when the file changed)."""
        return json.loads(json.dumps(self._manifest()))

    def _manifest(self) -> dict[str, Any]:
        path = self.path / MANIFEST
        try:
            st = path.stat()
            key = (st.st_mtime_ns, st.st_size, st.st_ino)
            if self._mcache is not None and self._mcache[0] == key:
                return self._mcache[1]
            m = json.loads(read_regular_bytes(path))  # a FIFO would block every command for ever
        except FileNotFoundError:
            raise BankError(f"{self.path}: not a memory bank (no {MANIFEST}); create one with `memgas ingest`") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BankError(f"{path}: corrupt manifest: {exc}") from None
        except NotARegularFile as exc:
            raise BankError(f"{path}: corrupt manifest: {exc.strerror}") from None
        if not isinstance(m, dict):
            raise BankError(f"{path}: corrupt manifest: expected a JSON object")
        self._mcache = (key, m)
        return m

    def update_manifest(self, **fields: Any) -> dict[str, Any]:
        """Merge ``fields`` into the manifest (dicts are merged one level deep) and write it atomically."""
        m = self.manifest
        for k, v in fields.items():
            if isinstance(v, dict) and isinstance(m.get(k), dict):
                m[k] = {**m[k], **v}
            else:
                m[k] = v
        m["row_counts"] = {name: self.count(name) for name in self.tables()}
        atomic_write_json(self.path / MANIFEST, m, point="bank:manifest")
        return m

    # -- parts --------------------------------------------------------------------------------
    def _dir(self, name: str) -> Path:
        return self.path / name

    def tables(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir() if p.is_dir() and (p / "_done").is_dir())

    def _marked(self, name: str) -> list[str]:
        done = self._dir(name) / "_done"
        if not done.is_dir():
            return []
        return sorted(p.stem for p in done.glob("*.json") if (self._dir(name) / f"{p.stem}.parquet").exists())

    def ingest_parts(self) -> set[str] | None:
        """Names of the committed ingest parts (the same in every ingest table); None for a bank written
        before ingest commits existed (then every ``ingest-*`` part counts)."""
        rec = self._manifest().get("ingest")
        if not isinstance(rec, dict):
            return None
        return set(rec.get("parts") or [])

    def parts(self, name: str) -> list[str]:
        """Completed parts of a table, in name order (only parts whose marker exists; for the ingest
        tables only the committed ``ingest-*`` parts)."""
        names = self._marked(name)
        if name in INGEST_TABLES:
            committed = self.ingest_parts()
            if committed is not None:
                names = [p for p in names if not p.startswith(INGEST_PREFIX) or p in committed]
        return names

    def missing_ingest_parts(self) -> list[str]:
        """``table/part`` of every committed ingest part that is not there (deleted or never completed)."""
        committed = self.ingest_parts()
        if not committed:
            return []
        missing = []
        for name in INGEST_TABLES:
            have = set(self._marked(name))
            missing += [f"{name}/{p}" for p in sorted(committed - have)]
        return missing

    def damaged_ingest_parts(self) -> list[str]:
        """``table/part`` of every committed ingest part that is missing or whose bytes are not those
        written (checked against the digest in its marker)."""
        committed = self.ingest_parts()
        if not committed:
            return []
        return [f"{name}/{p}" for name in INGEST_TABLES for p in sorted(committed) if not self.verify_part(name, p)]

    def ingest_complete(self) -> bool:
        """Whether every committed ingest part is present (a bank that needs no re-ingest)."""
        return not self.missing_ingest_parts()

    def has_part(self, name: str, part: str) -> bool:
        return (self._dir(name) / "_done" / f"{part}.json").exists() and (
            self._dir(name) / f"{part}.parquet"
        ).exists()

    def part_digest(self, name: str, part: str) -> str | None:
        """The digest of a completed part's bytes as it was written (its marker; a compacted part's name),
        or None when the part is not there (no marker or no file). Markers of banks written before digests
        existed carry none: then the part's current bytes stand in (nothing to compare against)."""
        marker = self._dir(name) / "_done" / f"{part}.json"
        path = self._dir(name) / f"{part}.parquet"
        try:
            info = json.loads(read_regular_bytes(marker))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        if not path.is_file():
            return None
        digest = info.get("digest") if isinstance(info, dict) else None
        if not digest and part.startswith(COMPACT_PREFIX) and len(part) == len(COMPACT_PREFIX) + 16:
            digest = part[len(COMPACT_PREFIX):]
        return str(digest) if digest else self.current_digest(name, part)

    def current_digest(self, name: str, part: str) -> str | None:
        """The digest of a part's bytes now (None when the file is gone, or is a FIFO, a device or a folder:
        never read, as /dev/zero would be for ever)."""
        path = self._dir(name) / f"{part}.parquet"
        try:
            return file_digest(path)
        except (FileNotFoundError, NotARegularFile):
            return None

    def verify_part(self, name: str, part: str, expected: str | None = None) -> bool:
        """Whether a part is complete and its bytes are those written (and, given, equal ``expected``): a
        deleted, truncated or altered part is not."""
        recorded = self.part_digest(name, part)
        if recorded is None or (expected is not None and recorded != expected):
            return False
        # the file's type and recorded size are checked before a byte is hashed
        return file_matches(self._dir(name) / f"{part}.parquet", recorded, self._recorded_bytes(name, part))

    def _recorded_bytes(self, name: str, part: str) -> int | None:
        """A part's size in its marker (markers written before sizes were recorded have none)."""
        try:
            size = json.loads(read_regular_bytes(self._dir(name) / "_done" / f"{part}.json")).get("bytes")
        except (OSError, ValueError, AttributeError):
            return None
        return size if isinstance(size, int) and not isinstance(size, bool) else None

    def write_part(
        self, name: str, part: str, table: pa.Table, *, dim: int | None = None, info: dict | None = None
    ) -> Path:
        """Write one part atomically, then its completion marker. Replaces a part of the same name.

        Fault points: ``bank:write-part:before-rename`` (the part's bytes are in a temp file) and
        ``bank:write-part:before-marker`` (the part is in place, not yet marked: readers ignore it).
        """
        if not part or "/" in part or part.startswith((".", "_")):
            raise ValueError(f"bad part name {part!r}")
        if name in VECTOR_TABLES and dim is None:  # the vectors' fixed size is the dimension
            dim = getattr(table.schema.field("vector").type, "list_size", None)
        table = conform(table, schema_for(name, dim), name)
        path = self._dir(name) / f"{part}.parquet"
        marker = self._dir(name) / "_done" / f"{part}.json"
        marker.unlink(missing_ok=True)  # a crash from here on leaves an unmarked part: ignored, redone
        _sweep_temps(self._dir(name), f".{part}.parquet.")  # of an earlier write of this part, killed
        atomic_write_parquet(path, table, point="bank:write-part", table_name=name)
        faults.hit("bank:write-part:before-marker")
        atomic_write_json(marker, {"rows": table.num_rows, "digest": _file_digest(path),
                                   "bytes": path.stat().st_size, **(info or {})},
                          point="bank:write-marker")
        return path

    def write(self, name: str, table: pa.Table, *, dim: int | None = None, info: dict | None = None) -> str:
        """Replace the table with ``table``, crash-safely; returns the new part's name.

        The rows become one part ``all-<digest>`` that is written and marked before the parts it replaces
        are dropped (see the module docstring). Ingest's own parts of ``texts`` are kept, and rows they
        already hold are not written twice (texts are keyed by content, so those rows are equal).
        """
        if name in VECTOR_TABLES and dim is None:
            dim = getattr(table.schema.field("vector").type, "list_size", None)
        table = conform(table, schema_for(name, dim), name)
        pinned = self._pinned(name)
        if pinned and table.num_rows and len(KEYS.get(name, ())) == 1:
            key = KEYS[name][0]
            held = pa.concat_tables(
                [self._read_part(name, p, [key]) for p in pinned], promote_options="permissive").column(key)
            table = table.filter(pc.invert(pc.is_in(table.column(key), value_set=pc.unique(held))))
        replace = [p for p in self.parts(name) if not (name in INGEST_TABLES and p.startswith(INGEST_PREFIX))]
        return self._commit_compacted(name, table, replace, info)

    def compact(self, name: str, *, dim: int | None = None) -> int:
        """Merge the table's parts (ingest's own parts excepted) into one part sorted by key; returns the
        table's rows.

        Tiered: a compacted part that holds at least :data:`TIER_RATIO` times the rows of all the other parts
        together, and none of their keys, is left as it is, and only the others are merged (into a second
        compacted part). An append then rewrites what it added, not the table (the ``embeddings`` of a
        10^6-session history: ~9 GB). The rows read are the same either way: no key is in both parts.
        Crash-safe like :meth:`write`; a no-op when nothing is left to merge.
        """
        own = [p for p in self.parts(name) if not (name in INGEST_TABLES and p.startswith(INGEST_PREFIX))]
        if not own:
            return 0
        if len(own) == 1 and own[0].startswith(COMPACT_PREFIX):
            return self._rows(name, own[0])
        if name not in KEYS:  # no key to merge by: the rows in part order, as read
            table = self.read(name, parts=own)
            self.write(name, table, dim=dim)
            return table.num_rows
        base = self._tier_base(name, own)
        if base is None:
            return self._compact_streamed(name, own, dim)
        rest = [p for p in own if p != base]
        if len(rest) == 1 and rest[0].startswith(COMPACT_PREFIX):
            return self._rows(name, base) + self._rows(name, rest[0])
        return self._rows(name, base) + self._compact_streamed(name, rest, dim)

    def _tier_base(self, name: str, own: list[str]) -> str | None:
        """The compacted part that :meth:`compact` leaves alone, or None (merge everything)."""
        compacted = [p for p in own if p.startswith(COMPACT_PREFIX)]
        if not compacted or len(own) < 2:
            return None
        rows = {p: self._rows(name, p) for p in own}
        base = max(compacted, key=lambda p: (rows[p], p))
        if rows[base] < TIER_RATIO * sum(n for p, n in rows.items() if p != base):
            return None
        return None if self._keys_overlap(name, base, [p for p in own if p != base]) else base

    def _keys_overlap(self, name: str, base: str, others: list[str]) -> bool:
        """Whether a key of ``others`` is also in ``base`` (read a batch at a time: only key columns). A null
        key counts as an overlap (merge everything, as before)."""
        keys = list(KEYS[name])

        def joined(t: pa.Table) -> pa.Array | None:
            cols = [t.column(k) for k in keys]
            if any(c.null_count for c in cols):
                return None
            if len(cols) == 1:
                return cols[0].cast(pa.string())
            return pc.binary_join_element_wise(*[c.cast(pa.string()) for c in cols], "\0")

        theirs = [joined(self._read_part(name, p, keys)) for p in others]
        if any(k is None for k in theirs):
            return True
        wanted = pc.unique(pa.chunked_array(theirs, pa.string()))
        for batch in self.iter_read(name, keys, batch_rows=1 << 16, parts=[base]):
            mine = joined(batch)
            if mine is None or pc.any(pc.is_in(mine, value_set=wanted)).as_py():
                return True
        return False

    def _compact_streamed(self, name: str, own: list[str], dim: int | None) -> int:
        """:meth:`compact` of a keyed table, merged in bounded memory (:mod:`memgas.pipeline.compaction`):
        the same rows, in the same order, as ``key_order`` of :meth:`read` written by :meth:`write`."""
        d = self._dir(name)
        if name == "embeddings" and dim is None:  # the vectors' fixed size is the dimension
            dim = self._embeddings_dim(own[0], d / f"{own[0]}.parquet")
        schema = schema_for(name, dim)
        pinned = self._pinned(name)
        held = None
        if pinned and len(KEYS[name]) == 1:  # rows ingest's own parts hold are not written twice (as write)
            key = KEYS[name][0]
            held = pc.unique(pa.concat_tables([self._read_part(name, p, [key]) for p in pinned],
                                              promote_options="permissive").column(key))
        fd, tmp = _mkstemp(d / "compact.parquet")
        os.close(fd)
        try:
            with pq.ParquetWriter(tmp, schema, **parquet_options(name)) as writer:
                rows = 0
                for group in regroup(without_keys(self.iter_merged(name, own), KEYS[name][0], held),
                                     row_group_rows(name)):
                    writer.write_table(conform(group, schema, name), row_group_size=group.num_rows)
                    rows += group.num_rows
                    faults.hit("bank:compact:merging")  # scratch and temp file in place, nothing committed
                if rows == 0:
                    writer.write_table(schema.empty_table())
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._commit_file(name, Path(tmp), rows, own, None)
        return rows

    def iter_merged(self, name: str, parts: list[str] | None = None) -> Iterator[pa.Table]:
        """The rows of ``parts`` (default: every completed part) of keyed table ``name`` as :meth:`read` gives
        them (one row per key, the last written), in key order, in batches of any size, without holding the
        table (:func:`memgas.pipeline.compaction.merged`)."""
        if parts is None:
            self._check_ingest(name)
        own = self.parts(name) if parts is None else parts
        d = self._dir(name)
        paths = [d / f"{p}.parquet" for p in own]
        for part, path in zip(own, paths):
            try:
                regular_file_size(path)  # a FIFO would block the reader for ever
            except OSError as exc:
                raise self._unreadable(name, part, path, exc) from None
        if not paths:
            return
        with process_directory(COMPACT_SCRATCH_PREFIX, str(d)) as scratch:
            try:
                yield from merged(paths, KEYS[name], scratch=Path(scratch))
            except PartUnreadable as exc:
                raise self._unreadable(name, own[exc.index], paths[exc.index], exc.exc) from None
            except SchemasDisagree as exc:
                raise BankError(f"{d}: the parts of table {name!r} hold a column of different types ({exc}); "
                                "delete the parts that are not the stage's and re-run") from None

    def _embeddings_dim(self, part: str, path: Path) -> int | None:
        try:
            regular_file_size(path)  # a FIFO would block the reader for ever
            return getattr(pq.read_schema(path).field("vector").type, "list_size", None)
        except (OSError, pa.ArrowException, KeyError) as exc:
            raise self._unreadable("embeddings", part, path, exc) from None

    def _pinned(self, name: str) -> list[str]:
        """Parts of ``name`` that compaction must keep: ingest's own (ingest tables only)."""
        if name not in INGEST_TABLES:
            return []
        return [p for p in self.parts(name) if p.startswith(INGEST_PREFIX)]

    def _commit_compacted(self, name: str, table: pa.Table, replace: list[str], info: dict | None) -> str:
        """Write ``table`` as a new marked part, then drop ``replace``. Fault points (in order):
        ``bank:compact:before-rename``, ``bank:compact:before-marker``, ``bank:compact:after-new`` (new
        part committed, old parts still there), ``bank:compact:dropped`` (after each old part dropped)."""
        fd, tmp = _mkstemp(self._dir(name) / "compact.parquet")
        os.close(fd)
        try:
            _write_parquet(tmp, table, name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return self._commit_file(name, Path(tmp), table.num_rows, replace, info)

    def _commit_file(self, name: str, tmp: Path, rows: int, replace: list[str], info: dict | None) -> str:
        """Commit the written temp file ``tmp`` (``rows`` rows) as the part that replaces ``replace``."""
        d = self._dir(name)
        try:
            part = f"{COMPACT_PREFIX}{_file_digest(tmp)}"
            faults.hit("bank:compact:before-rename")
            if self.has_part(name, part):  # the same bytes are committed already (a re-run, or a resumed one)
                Path(tmp).unlink()
            else:
                (d / "_done" / f"{part}.json").unlink(missing_ok=True)
                os.replace(tmp, d / f"{part}.parquet")
                faults.hit("bank:compact:before-marker")
                atomic_write_json(d / "_done" / f"{part}.json",
                                  {"rows": rows, "digest": part[len(COMPACT_PREFIX):],
                                   "bytes": (d / f"{part}.parquet").stat().st_size,
                                   "replaces": sorted(p for p in replace if p != part), **(info or {})},
                                  point="bank:compact-marker")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        faults.hit("bank:compact:after-new")
        for old in replace:
            if old != part:
                self.drop_part(name, old)
                faults.hit("bank:compact:dropped")
        # leftovers of compactions killed before their marker: unmarked, never read, safe to remove
        for f in d.glob(f"{COMPACT_PREFIX}*.parquet"):
            if f.stem != part and not (d / "_done" / f"{f.stem}.json").exists():
                f.unlink(missing_ok=True)
        legacy = d / "all.parquet"
        if legacy.exists() and not (d / "_done" / "all.json").exists():
            legacy.unlink(missing_ok=True)
        _sweep_temps(d, ".compact.parquet.")
        _sweep_temps(d / "_done", f".{COMPACT_PREFIX}")
        return part

    def drop_part(self, name: str, part: str) -> None:
        """Unmark, then delete (a kill in between leaves an unmarked file: ignored)."""
        (self._dir(name) / "_done" / f"{part}.json").unlink(missing_ok=True)
        (self._dir(name) / f"{part}.parquet").unlink(missing_ok=True)

    def drop(self, name: str) -> None:
        for part in self.parts(name):
            self.drop_part(name, part)

    # -- ingest commits (used by memgas.pipeline.ingest) --------------------------------------------
    def begin_ingest(self) -> str:
        """Prepare a new ingest: returns the slot (``a`` or ``b``) its parts must use, the one not committed.

        Removes what earlier killed ingests left (parts not committed, marked or not). A bank written
        before ingest commits existed first gets its present ``ingest-*`` parts recorded as committed.
        """
        committed = self.ingest_parts()
        if committed is None:  # legacy bank: record what is there, so that new parts stay invisible
            legacy = sorted({p for name in INGEST_TABLES for p in self._marked(name) if p.startswith(INGEST_PREFIX)})
            m = self.manifest
            m["ingest"] = {"parts": legacy}
            atomic_write_json(self.path / MANIFEST, m, point="bank:manifest")
            committed = set(legacy)
        self._drop_uncommitted_ingest(committed)
        slots = {p[len(INGEST_PREFIX)] for p in committed if p[len(INGEST_PREFIX):][1:2] == "-"}
        return "b" if slots == {"a"} else "a"

    def _drop_uncommitted_ingest(self, committed: set[str]) -> None:
        for name in INGEST_TABLES:
            d = self._dir(name)
            if not d.is_dir():
                continue
            for f in list(d.glob(f"{INGEST_PREFIX}*.parquet")) + list((d / "_done").glob(f"{INGEST_PREFIX}*.json")):
                if f.stem not in committed:
                    f.unlink(missing_ok=True)

    def commit_ingest(self, parts: list[str], **manifest_fields: Any) -> None:
        """Make ``parts`` the bank's ingest (one atomic manifest write, together with ``manifest_fields``),
        then drop the parts of the previous ingest. Fault points ``ingest:before-commit`` (new parts
        complete, not committed), ``bank:manifest:before-rename`` and ``ingest:after-commit`` (committed,
        old parts still on disk; invisible)."""
        missing = [f"{n}/{p}" for n in INGEST_TABLES for p in parts if not self.has_part(n, p)]
        if missing:
            raise BankError(f"{self.path}: cannot commit the ingest: parts {missing[:3]} are not complete")
        faults.hit("ingest:before-commit")
        m = self.manifest
        for k, v in manifest_fields.items():  # merged like update_manifest
            m[k] = {**m[k], **v} if isinstance(v, dict) and isinstance(m.get(k), dict) else v
        m["ingest"] = {"parts": list(parts)}
        atomic_write_json(self.path / MANIFEST, m, point="bank:manifest")
        faults.hit("ingest:after-commit")
        self._drop_uncommitted_ingest(set(parts))  # the previous ingest's parts
        faults.hit("ingest:after-drop-old")
        self.update_manifest()  # row counts of the new data

    def abort_ingest(self) -> None:
        """Drop the parts of an ingest that will not be committed (the committed data is untouched)."""
        committed = self.ingest_parts()
        self._drop_uncommitted_ingest(committed or set())

    # -- reading ------------------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        """Whether the table has data. For an ingest table: also whether the whole ingest is intact (a
        bank with a missing ingest part holds no usable dataset; the next run re-ingests)."""
        if name in INGEST_TABLES and self.missing_ingest_parts():
            return False
        return bool(self.parts(name))

    def _check_ingest(self, name: str) -> None:
        if name in INGEST_TABLES:
            missing = self.missing_ingest_parts()
            if missing:
                raise BankError(
                    f"{self.path}: the ingested dataset is incomplete ({missing[0]} is missing"
                    + (f", and {len(missing) - 1} more" if len(missing) > 1 else "")
                    + "); " + self.reingest_advice()
                )

    def reingest_advice(self) -> str:
        """What rebuilds the ingested dataset (an ingest part cannot be rebuilt from the bank): its ingest and
        every append, spelled out; `memgas run` too, unless the bank was grown (run refuses a grown bank)."""
        from memgas.pipeline.append import appended_files, rebuild_commands  # append builds on this module

        try:
            cmds, grown = rebuild_commands(self), bool(appended_files(self))
        except BankError:  # the manifest itself is unreadable
            return "re-ingest it (`memgas ingest`)"
        return f"re-ingest it: {cmds}" + ("" if grown else " (or memgas run, which re-ingests by itself)")

    def _read_part(self, name: str, part: str, columns: list[str] | None = None, filter: pc.Expression | None = None,
                   batch_rows: int | None = None) -> pa.Table:
        path = self._dir(name) / f"{part}.parquet"
        try:
            regular_file_size(path)  # a FIFO would block the reader for ever
            if batch_rows is not None:
                return _read_streamed(path, columns, filter, batch_rows)
            return pq.read_table(path, columns=columns, filters=filter)
        except (OSError, pa.ArrowException) as exc:
            raise self._unreadable(name, part, path, exc) from None

    def _unreadable(self, name: str, part: str, path: Path, exc: BaseException) -> BankError:
        if name in INGEST_TABLES and part.startswith(INGEST_PREFIX):
            advice = self.reingest_advice()
        else:
            advice = "delete it and re-run the stage that wrote it"
        return BankError(f"{path}: unreadable Parquet part ({_reason(exc)}); {advice}")

    def iter_read(self, name: str, columns: list[str], *, batch_rows: int,
                  parts: list[str] | None = None) -> Iterator[pa.Table]:
        """Every completed part of ``name`` (or ``parts``), in part order, ``batch_rows`` rows at a time
        (buffered page reads, as :meth:`read` with ``batch_rows``), without de-duplication: a caller that
        keeps the last row of a key, as :meth:`read` does, lets later batches win. Memory: about one row
        group."""
        self._check_ingest(name)
        for part in self.parts(name) if parts is None else parts:
            path = self._dir(name) / f"{part}.parquet"
            try:
                regular_file_size(path)
                f = pq.ParquetFile(path, pre_buffer=False, buffer_size=STREAM_BUFFER)
                schema = pa.schema([f.schema_arrow.field(c) for c in columns])
                for batch in f.iter_batches(batch_size=batch_rows, columns=columns, use_threads=False):
                    yield pa.Table.from_batches([batch], schema)
            except (OSError, pa.ArrowException, KeyError) as exc:
                raise self._unreadable(name, part, path, exc) from None

    def iter_groups(self, name: str, part: str, columns: list[str], *, batch_rows: int,
                    groups: list[int] | None = None) -> Iterator[tuple[int, pa.Table]]:
        """``(row group, rows)`` of one completed part, ``batch_rows`` rows at a time, in row order: every
        row group, or only ``groups`` (ascending). For a reader that first reads a narrow column to learn
        which row groups hold what it needs, then reads only those groups' wide columns."""
        path = self._dir(name) / f"{part}.parquet"
        try:
            regular_file_size(path)
            f = pq.ParquetFile(path, pre_buffer=False, buffer_size=STREAM_BUFFER)
            schema = pa.schema([f.schema_arrow.field(c) for c in columns])
            for g in range(f.num_row_groups) if groups is None else groups:
                for batch in f.iter_batches(batch_size=batch_rows, row_groups=[g], columns=columns,
                                            use_threads=False):
                    yield g, pa.Table.from_batches([batch], schema)
        except (OSError, pa.ArrowException, KeyError) as exc:
            raise self._unreadable(name, part, path, exc) from None

    def read(
        self,
        name: str,
        columns: list[str] | None = None,
        *,
        parts: Iterable[str] | None = None,
        dedupe: bool = True,
        filter: pc.Expression | None = None,
        batch_rows: int | None = None,
    ) -> pa.Table:
        """All completed parts of ``name`` concatenated in part order; duplicate keys keep the last.

        ``batch_rows``: read each part ``batch_rows`` rows at a time and keep only the rows ``filter``
        selects (which then may name only the columns read), for a small selection out of a large table:
        a plain read decodes a whole row group (up to 1 Mi rows) before filtering. Same result."""
        if parts is None:
            self._check_ingest(name)
        chosen = list(parts) if parts is not None else self.parts(name)
        if not chosen:
            if name == "embeddings":
                raise BankError(f"{self.path}: table 'embeddings' is empty; run `memgas index` first")
            return schema_for(name).empty_table() if columns is None else schema_for(name).empty_table().select(columns)
        want = None
        if columns is not None and dedupe and name in KEYS:
            want = list(dict.fromkeys([*KEYS[name], *columns]))
        elif columns is not None:
            want = list(columns)
        tables = [self._read_part(name, part, want, filter, batch_rows) for part in chosen]
        table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
        if dedupe and name in KEYS and len(tables) > 1:
            table = dedupe_last(table, KEYS[name])
        return table.select(columns) if columns is not None else table

    def _rows(self, name: str, part: str) -> int:
        path = self._dir(name) / f"{part}.parquet"
        try:
            regular_file_size(path)  # a FIFO would block the reader for ever
            return pq.ParquetFile(path).metadata.num_rows
        except (OSError, pa.ArrowException) as exc:
            advice = self.reingest_advice() if name in INGEST_TABLES and part.startswith(INGEST_PREFIX) else \
                "delete it and re-run"
            raise BankError(f"{path}: unreadable Parquet part ({_reason(exc)}); {advice}") from None

    def count(self, name: str) -> int:
        """Rows of the table. Exact when a compacted part overlaps others (an interrupted compaction, or
        rows re-written since): then counted by unique key."""
        parts = self.parts(name)
        # an append rewrites the history rows it extends (and the session rows a reorder moves) in its parts
        rewritten = name in ("histories", "sessions") and sum(p.startswith(INGEST_PREFIX) for p in parts) > 1
        if len(parts) > 1 and name in KEYS and (rewritten or any(p.startswith(COMPACT_PREFIX) for p in parts)):
            return self.read(name, list(KEYS[name]), parts=parts).num_rows
        return sum(self._rows(name, p) for p in parts)
