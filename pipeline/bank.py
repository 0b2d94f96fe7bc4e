"""A memory bank: a directory of Parquet tables plus ``manifest.json``.

Layout::

    BANK/
      manifest.json                 schema version, datasets (sha256), committed ingest parts, row counts, ...
      <table>/<part>.parquet        one or more parts per table (see memgas.pipeline.schema)
      <table>/_done/<part>.json     completion marker of a part: written after the part, atomically

Why parts with markers: every job writes its shard as one part, atomically (temp file + rename), and
then its marker. A part without a marker (a kill between the two renames) is ignored by readers and
rewritten by the next run, so a killed job resumes without losing or duplicating rows. Re-writing a
part with the same name replaces it, which is what makes every stage idempotent. A marked part whose file
is not a regular file of the size its marker records (cut short, a FIFO, a symlink to /dev/zero) is damaged
and ignored the same way, never opened (:meth:`Bank.has_part`): its stage writes it again.

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

import json
import logging
import os
import stat
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memgas import __version__
from memgas.pipeline import faults
from memgas.pipeline.bank_compact import COMPACT_SCRATCH_PREFIX, COUNT_OF, TIER_RATIO, Compacting, parts_key
from memgas.pipeline.bank_files import (  # re-exported: the bank's public names, one import for its users
    COMPACT_PREFIX,
    INGEST_PREFIX,
    INGEST_TABLES,
    MANIFEST,
    STREAM_BUFFER,
    _file_digest,
    mkstemp_beside,
    _read_streamed,
    _reason,
    _sweep_temps,
    atomic_write_bytes,
    atomic_write_json,
    conform,
    dedupe_last,
    key_order,
    parquet_options,
)
from memgas.pipeline.bank_ingest import IngestCommits
from memgas.pipeline.bank_verified import forget, hash_and_record, verified_before
from memgas.pipeline.compaction import regroup
from memgas.pipeline.dataset_history import rebuild_advice
from memgas.pipeline.errors import BankError
from memgas.pipeline.hashing import NotARegularFile, file_digest, read_regular_bytes, regular_file_size
from memgas.pipeline.schema import KEYS, SCHEMA_VERSION, VECTOR_TABLES, schema_for

__all__ = ["COMPACT_PREFIX", "COMPACT_SCRATCH_PREFIX", "DEFAULT_ROW_GROUP_ROWS", "INGEST_PREFIX", "INGEST_TABLES",
           "MANIFEST", "ROW_GROUP_ROWS", "STREAM_BUFFER", "TIER_RATIO", "Bank", "atomic_write_bytes",
           "atomic_write_json", "atomic_write_parquet", "conform", "dedupe_last", "key_order", "parquet_options",
           "row_group_rows", "write_groups"]

log = logging.getLogger(__name__)


#: rows per Parquet row group of a table's parts where the writer's default (1 Mi rows) is too many: a
#: reader decodes a whole row group (nested columns too) even to keep a few rows of it, so a 1 Mi-row group
#: of 384-d vectors would be 1.5 GB in memory. 8,192 vectors are 12 MiB. ``ivf_index``: one row (one chunk
#: of a saved index, jobs/stages/associate.py) a group: Parquet buffers a whole column chunk while it writes
#: and reads one, several times over (a 1.5 GB index in one group took ~5 GB more to write and ~7 GB to
#: read; in groups of 64 MiB, 0.5 and 2 GB). Other tables keep the default.
ROW_GROUP_ROWS = {"embeddings": 8192, "node_blocks": 8192, "ivf_index": 1, "ivf_delta": 1,
                  "card_graph_ivf_index": 1, "card_graph_ivf_delta": 1}


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
    fd, tmp = mkstemp_beside(path)
    os.close(fd)
    try:
        _write_parquet(tmp, table, table_name)
        faults.hit(f"{point}:before-rename")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


#: part markers parsed by this process, by (path, mtime, size, inode): a marker is read once while unchanged
_MARKERS: dict[tuple[str, int, int, int], dict[str, Any] | None] = {}


def _marker(path: Path) -> dict[str, Any] | None:
    """A part's completion marker (a JSON object), or None: missing, not a regular file (never waited on),
    or not a JSON object."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (str(path), st.st_mtime_ns, st.st_size, st.st_ino)
    if key not in _MARKERS:
        try:
            info = json.loads(read_regular_bytes(path))
        except (OSError, ValueError):
            info = None
        if len(_MARKERS) > 100_000:
            _MARKERS.clear()
        _MARKERS[key] = info if isinstance(info, dict) else None
    return _MARKERS[key]


class Bank(Compacting, IngestCommits):
    """A memory bank directory. ``Bank.create`` makes one; ``Bank(path)`` opens an existing one.

    Compaction (:mod:`memgas.pipeline.bank_compact`) and the ingest commits
    (:mod:`memgas.pipeline.bank_ingest`) are its mixins."""

    def __init__(self, path: str | Path, *, _create: bool = False, _replace: bool = False) -> None:
        self.path = Path(path)
        self._mcache: tuple[tuple[int, int, int], dict[str, Any]] | None = None
        manifest = self.path / MANIFEST
        if _create:
            if self.path.exists() and not self.path.is_dir():
                raise BankError(f"{self.path}: exists and is not a directory")
            self.path.mkdir(parents=True, exist_ok=True)
            if not manifest.exists() or (_replace and self._manifest_problem() is not None):
                atomic_write_json(  # a rename: replaces a FIFO or a symlink itself, never writes through it
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
        if not manifest.exists():  # symlinks followed, nothing opened: a FIFO or /dev/zero is not waited on
            what = "no such directory" if not self.path.exists() else (
                "not a directory" if not self.path.is_dir() else f"no {MANIFEST}")
            raise BankError(f"{self.path}: not a memory bank ({what}); create one with `memgas ingest`")
        problem = self._manifest_problem()
        if problem is not None:  # there but unreadable (a FIFO, a device, a folder, not JSON): say so
            raise BankError(f"{problem}; start the bank over with `memgas ingest FILE --replace --out {self.path}`")
        version = self.manifest.get("schema_version")
        if version != SCHEMA_VERSION:
            raise BankError(
                f"{self.path}: bank schema version {version} but this memgas reads version {SCHEMA_VERSION}; "
                "re-create the bank with `memgas ingest` (or use the memgas release that wrote it)"
            )

    @classmethod
    def create(cls, path: str | Path, *, replace: bool = False) -> Bank:
        """Open the bank at ``path``, making an empty one when it has no manifest; ``replace``: also when its
        manifest cannot be read (``memgas ingest --replace`` starts such a bank over)."""
        return cls(path, _create=True, _replace=replace)

    def _manifest_problem(self) -> str | None:
        """Why the manifest that is there cannot be read (one line), or None when it reads."""
        try:
            self._manifest()
        except BankError as exc:
            return str(exc)
        return None

    # the writes of a part's file, for the mixins (module functions here: tests set ROW_GROUP_ROWS on this module)
    @staticmethod
    def _group_rows(name: str) -> int:
        return row_group_rows(name)

    @staticmethod
    def _write_file(path: str | Path, table: pa.Table, name: str | None) -> None:
        _write_parquet(path, table, name)

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
        # each count with the parts it is of (taken before it): a later count of the same parts takes it
        of = {name: self.parts_digests(name) for name in self.tables()}
        keys = {name: parts_key(pairs) for name, pairs in of.items()}
        m["row_counts"], m["row_count_parts"] = {name: self.count(name) for name in keys}, keys
        m[COUNT_OF] = of
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
        return sorted(p.stem for p in done.glob("*.json") if self.has_part(name, p.stem))

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
        return self._committed(name, self._marked(name))

    def damaged_parts(self, name: str) -> list[str]:
        """Marked parts whose file is there but not complete (:meth:`has_part`: not a regular file, another
        size than recorded, an unreadable marker): invisible to readers, listed for the checks that drop
        them and rebuild what they held."""
        done = self._dir(name) / "_done"
        if not done.is_dir():
            return []
        return self._committed(name, sorted(
            p.stem for p in done.glob("*.json")
            if os.path.lexists(self._dir(name) / f"{p.stem}.parquet") and not self.has_part(name, p.stem)))

    def _committed(self, name: str, names: list[str]) -> list[str]:
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
        """Whether the part is complete: its marker reads, and its file is a regular file (symlinks followed)
        of the size the marker records. A part that is not (a FIFO, a symlink to /dev/zero, a truncated or
        extended file, an unreadable marker) counts as damaged, hence missing: every reader passes it by
        without opening it, and the stage that wrote it writes it again (its marker's digest, checked
        before the stage's output is used, no longer matches). Two ``stat`` calls; the marker is parsed
        once per process while it is unchanged."""
        d = self._dir(name)
        info = _marker(d / "_done" / f"{part}.json")
        if info is None:
            return False
        try:
            st = os.stat(d / f"{part}.parquet")
        except OSError:
            return False
        size = info.get("bytes")
        return stat.S_ISREG(st.st_mode) and (not isinstance(size, int) or isinstance(size, bool) or size == st.st_size)

    def part_digest(self, name: str, part: str) -> str | None:
        """The digest of a completed part's bytes as it was written (its marker; a compacted part's name),
        or None when the part is not there (no marker or no file). Markers of banks written before digests
        existed carry none: then the part's current bytes stand in (nothing to compare against)."""
        if not self.has_part(name, part):  # no marker, no file, or a file that cannot be the one written
            return None
        info = _marker(self._dir(name) / "_done" / f"{part}.json") or {}
        digest = info.get("digest")
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
        # the file's type and recorded size are checked before a byte is hashed; a part hashed by an earlier
        # command and provably unchanged since is not hashed again (pipeline/bank_verified.py says why)
        path, size = self._dir(name) / f"{part}.parquet", self._recorded_bytes(name, part)
        return verified_before(path, recorded, size) or hash_and_record(path, recorded, size)

    def _part_marker(self, name: str, part: str) -> dict[str, Any] | None:
        return _marker(self._dir(name) / "_done" / f"{part}.json")

    def _recorded_bytes(self, name: str, part: str) -> int | None:
        """A part's size in its marker (markers written before sizes were recorded have none)."""
        size = (_marker(self._dir(name) / "_done" / f"{part}.json") or {}).get("bytes")
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

    def drop_part(self, name: str, part: str) -> None:
        """Unmark, then delete (a kill in between leaves an unmarked file: ignored)."""
        (self._dir(name) / "_done" / f"{part}.json").unlink(missing_ok=True)
        (self._dir(name) / f"{part}.parquet").unlink(missing_ok=True)
        forget(self._dir(name) / f"{part}.parquet")

    def drop(self, name: str) -> None:
        for part in self.parts(name):
            self.drop_part(name, part)

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
        try:
            datasets = self.manifest.get("datasets") or []
        except BankError:  # the manifest itself is unreadable
            return "re-ingest it (`memgas ingest`)"
        return rebuild_advice(datasets, self.path)

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
        # two parts recorded disjoint (tiered compaction) hold each key once: nothing to de-duplicate (a
        # group-by over the ~5M keys of `embeddings` at 10^6 sessions, seconds per read)
        if dedupe and name in KEYS and len(tables) > 1 and not self.disjoint(name, chosen):
            table = dedupe_last(table, KEYS[name])
        return table.select(columns) if columns is not None else table

    def part_rows(self, name: str, part: str) -> int:
        """Rows of one part, from its Parquet metadata (no row is read)."""
        return self._rows(name, part)

    def _rows(self, name: str, part: str) -> int:
        path = self._dir(name) / f"{part}.parquet"
        try:
            regular_file_size(path)  # a FIFO would block the reader for ever
            return pq.ParquetFile(path).metadata.num_rows
        except (OSError, pa.ArrowException) as exc:
            advice = self.reingest_advice() if name in INGEST_TABLES and part.startswith(INGEST_PREFIX) else \
                "delete it and re-run"
            raise BankError(f"{path}: unreadable Parquet part ({_reason(exc)}); {advice}") from None

