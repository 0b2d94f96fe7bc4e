"""Compaction of a bank's tables: a table's parts merged into one part, committed crash-safely.

A mixin of :class:`memgas.pipeline.bank.Bank` (the bank's methods ``compact``, ``iter_merged`` and the
commit of a merged part), kept apart so that the bank's reading and writing of parts reads on its own. The
commit point is described in :mod:`memgas.pipeline.bank`; the merge in :mod:`memgas.pipeline.compaction`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memgas.pipeline import faults
from memgas.pipeline.bank_files import (
    COMPACT_PREFIX,
    INGEST_PREFIX,
    INGEST_TABLES,
    _file_digest,
    mkstemp_beside,
    _sweep_temps,
    atomic_write_json,
    conform,
    parquet_options,
)
from memgas.pipeline.compaction import PartUnreadable, SchemasDisagree, merged, regroup, without_keys
from memgas.pipeline.errors import BankError
from memgas.pipeline.hashing import regular_file_size
from memgas.pipeline.process_dirs import process_directory
from memgas.pipeline.schema import KEYS, schema_for

#: :meth:`Bank.compact` leaves a compacted part alone when it holds this many times the rows of the others
TIER_RATIO = 8
#: scratch directories of a compaction (sorted copies of parts not in key order), beside the table's parts
COMPACT_SCRATCH_PREFIX = ".compact-runs-"


class Compacting:
    """The compaction methods of :class:`~memgas.pipeline.bank.Bank` (which supplies the part reads and
    writes they call: ``parts``, ``read``, ``_read_part``, ``_rows``, ``drop_part``, ``_write_file``, ...)."""

    path: Path

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
        fd, tmp = mkstemp_beside(d / "compact.parquet")
        os.close(fd)
        try:
            with pq.ParquetWriter(tmp, schema, **parquet_options(name)) as writer:
                rows = 0
                for group in regroup(without_keys(self.iter_merged(name, own), KEYS[name][0], held),
                                     self._group_rows(name)):
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
        fd, tmp = mkstemp_beside(self._dir(name) / "compact.parquet")
        os.close(fd)
        try:
            self._write_file(tmp, table, name)
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
