"""Compaction of a bank's tables: a table's parts merged into one part, committed crash-safely.

A mixin of :class:`memgas.pipeline.bank.Bank` (the bank's methods ``compact``, ``iter_merged`` and the
commit of a merged part), kept apart so that the bank's reading and writing of parts reads on its own. The
commit point is described in :mod:`memgas.pipeline.bank`; the merge in :mod:`memgas.pipeline.compaction`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memgas.pipeline import faults
from memgas.pipeline.bank_files import (
    COMPACT_PREFIX,
    INGEST_PREFIX,
    INGEST_TABLES,
    MANIFEST,
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
#: field of the marker of a part merged beside a large compacted part (:meth:`Compacting.compact`): that
#: part's name, recorded when neither part holds a key twice and no key is in both, so that
#: ``Bank.count`` of a table of just those two parts adds their rows instead of reading every key
DISJOINT_FROM = "disjoint_from"
#: manifest field: per table, the parts and recorded digests its ``row_counts`` entry is of, so that a count
#: after parts were only added starts from it (:meth:`Compacting.count`)
COUNT_OF = "row_count_of"


@dataclass(frozen=True)
class _BaseScan:
    """What one pass over the key columns of the large compacted part found (:meth:`Compacting._scan_base`)."""

    repeated: pa.Array  # the other parts' keys that it holds too (joined, as :func:`_joined`), unique
    base_groups: list[int]  # its row groups that hold them
    holders: list[str]  # the other parts that hold them
    base_unique: bool  # its keys strictly increase: none is there twice
    keys: int  # how many keys the other parts hold


@dataclass(frozen=True)
class _Tier:
    """How :meth:`Compacting.compact` merges beside the large compacted part ``base``."""

    base: str
    repeated: pa.Array  # keys whose rows in the other parts are all ``base``'s: left out of the merge
    base_unique: bool
    covered: bool  # every key of the other parts is one of those


def parts_key(pairs: list[list[str | None]]) -> str:
    """A digest of a table's ``[part, recorded digest]`` pairs (:meth:`Compacting.parts_key`)."""
    return hashlib.blake2b(json.dumps(pairs).encode(), digest_size=8).hexdigest()


def _joined(t: pa.Table, keys: list[str]) -> pa.Array:
    """The key of each row of ``t`` as one string (key columns joined by NUL; null when one is null), to
    match keys of several columns with ``is_in``."""
    cols = [t.column(k).combine_chunks() for k in keys]
    if len(cols) == 1:
        return cols[0].cast(pa.string())
    return pc.binary_join_element_wise(*[c.cast(pa.string()) for c in cols], "\0")


def _increasing(keys: pa.Array, before: pa.Scalar | None) -> bool:
    """Whether ``keys`` strictly increase, and start above ``before`` (the last key of the batch before):
    then no key is there twice, whatever the keys' order means."""
    if len(keys) == 0:
        return True
    if before is not None and not pc.less(before, keys[0]).as_py():
        return False
    return pc.all(pc.less(keys.slice(0, len(keys) - 1), keys.slice(1))).as_py() is not False


def _without_joined(tables: Iterable[pa.Table], keys: list[str], drop: pa.Array | None) -> Iterator[pa.Table]:
    """``tables`` without the rows whose key (joined, as :func:`_joined`) is in ``drop``."""
    for t in tables:
        yield t if drop is None or not len(drop) else t.filter(pc.invert(pc.is_in(_joined(t, keys), value_set=drop)))


def _same_bits(a: pa.Array, b: pa.Array) -> bool:
    """Whether two arrays hold the same values bit for bit. Arrow's ``equals`` takes -0.0 for 0.0 and a NaN
    for no NaN, so floating-point values are compared as their bits, nested ones value by value; a type
    this does not know compares unequal (the caller then merges everything, which is always right)."""
    if a.type != b.type or len(a) != len(b) or not a.is_valid().equals(b.is_valid()):
        return False
    t = a.type
    if pa.types.is_dictionary(t):
        return _same_bits(a.dictionary_decode(), b.dictionary_decode())
    if pa.types.is_floating(t):
        bits = {16: pa.uint16(), 32: pa.uint32(), 64: pa.uint64()}[t.bit_width]
        return a.view(bits).equals(b.view(bits))
    if pa.types.is_fixed_size_list(t):
        return _same_bits(a.flatten(), b.flatten())  # null lists' values skipped
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return (pc.list_value_length(a).equals(pc.list_value_length(b))
                and _same_bits(a.flatten(), b.flatten()))
    if pa.types.is_struct(t):  # the struct's nulls merged into each field's
        return all(_same_bits(x, y) for x, y in zip(a.flatten(), b.flatten()))
    if pa.types.is_nested(t):
        return False
    return a.equals(b)


class Compacting:
    """The compaction methods of :class:`~memgas.pipeline.bank.Bank` (which supplies the part reads and
    writes they call: ``parts``, ``read``, ``_read_part``, ``_rows``, ``drop_part``, ``_write_file``, ...)."""

    path: Path

    def compact(self, name: str, *, dim: int | None = None) -> int:
        """Merge the table's parts (ingest's own parts excepted) into one part sorted by key (:meth:`_compact`);
        returns the table's rows. A compaction leaves the rows read as they are, so the table's count of
        unique keys taken cheaply before it (:meth:`_count_kept`) is recorded for the parts after it: the
        next manifest update does not read every key of ``texts`` (~6M at 10^6 sessions, ~3.5 s) because a
        stage compacted its new rows."""
        kept = self._count_kept(name)
        rows = self._compact(name, dim)
        if kept is not None:
            self._record_count(name, kept)
        return rows

    def _count_kept(self, name: str) -> int | None:
        """The table's count of unique keys from the manifest (its count of these parts, or of fewer:
        :meth:`_grown_count`); None where only reading every key gives
        it, or where the count is a sum of rows that may repeat a key (a compaction would change it). Only
        for ingest's tables: the others are left as one part or as two disjoint ones, counted from their
        metadata (a pass over the keys of ``embeddings`` here took ~6 s at 10^6 sessions, for nothing)."""
        parts = self.parts(name)
        if name not in INGEST_TABLES or not self._counted_by_key(name, parts):
            return None
        m = self.manifest
        if (m.get("row_count_parts") or {}).get(name) == self.parts_key(name, parts):
            known = (m.get("row_counts") or {}).get(name)
            return known if isinstance(known, int) and not isinstance(known, bool) and known >= 0 else None
        return self._grown_count(name, parts)

    def _record_count(self, name: str, count: int) -> None:
        """Record ``count`` in the manifest as the count of the table's parts now (as update_manifest does).
        A manifest that never held counts is left alone; a write that fails (a full disk) records nothing,
        and the next count reads the keys."""
        m = self.manifest
        if not all(isinstance(m.get(k), dict) for k in ("row_counts", "row_count_parts", COUNT_OF)):
            return
        pairs = self.parts_digests(name)
        if m["row_count_parts"].get(name) == parts_key(pairs) and m["row_counts"].get(name) == count:
            return  # recorded already (nothing was merged)
        m["row_counts"][name], m["row_count_parts"][name], m[COUNT_OF][name] = count, parts_key(pairs), pairs
        try:
            atomic_write_json(self.path / MANIFEST, m, point="bank:count-record")
        except OSError:
            return

    def _compact(self, name: str, dim: int | None) -> int:
        """:meth:`compact`'s merge.

        Tiered: a compacted part that holds at least :data:`TIER_RATIO` times the rows of all the other parts
        together is left as it is, and only the others are merged (into a second compacted part), when each
        of their rows whose key the large part holds too is that part's row, bit for bit. An append then
        rewrites what it added, not the table (the ``embeddings`` of a 10^6-session history: ~9 GB), and a
        content-addressed row written again (a keyword text equal to a session's text) does not change
        that. Those repeated rows are left out of the merge, so no key is in both parts, and the rows read
        are the same either way. A repeated key with another value (a generation retried) must win over
        the large part's row, which only one merged part can promise: then everything is merged, as when
        a key is null. Crash-safe like :meth:`write`; a no-op when nothing is left to merge.
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
        tier = self._tier(name, own, dim)
        if tier is None:
            return self._compact_streamed(name, own, dim)
        rest = [p for p in own if p != tier.base]
        rows = self._rows(name, tier.base)
        if tier.covered:  # every row of the others is the large part's already: nothing to write
            for part in rest:
                self.drop_part(name, part)
                faults.hit("bank:compact:dropped")
            return rows
        if not len(tier.repeated) and len(rest) == 1 and rest[0].startswith(COMPACT_PREFIX):
            return rows + self._rows(name, rest[0])
        info = {DISJOINT_FROM: tier.base} if tier.base_unique else None
        return rows + self._compact_streamed(name, rest, dim, drop=tier.repeated, info=info)

    def count(self, name: str) -> int:
        """Rows of the table. Exact when a compacted part overlaps others (an interrupted compaction, or
        rows re-written since): then counted by unique key, unless the parts are known to share no key. The
        count the manifest holds for the same parts (:meth:`parts_key`) is taken as it is: counting the
        ~6M keys of ``texts`` at 10^6 sessions took ~4 s, on every manifest update."""
        parts = self.parts(name)
        m = self.manifest
        if (m.get("row_count_parts") or {}).get(name) == self.parts_key(name, parts):
            known = (m.get("row_counts") or {}).get(name)
            if isinstance(known, int) and not isinstance(known, bool):
                return known
        if self._counted_by_key(name, parts) and not self.disjoint(name, parts):
            grown = self._grown_count(name, parts)
            return grown if grown is not None else self.read(name, list(KEYS[name]), parts=parts).num_rows
        return sum(self._rows(name, p) for p in parts)

    @staticmethod
    def _counted_by_key(name: str, parts: list[str]) -> bool:
        """Whether :meth:`count` of ``parts`` is their unique keys (parts that may share keys), not the sum of
        their rows."""
        # an append rewrites the history rows it extends (and the session rows a reorder moves) in its parts
        rewritten = name in ("histories", "sessions") and sum(p.startswith(INGEST_PREFIX) for p in parts) > 1
        return len(parts) > 1 and name in KEYS and (rewritten or any(p.startswith(COMPACT_PREFIX) for p in parts))

    def _grown_count(self, name: str, parts: list[str]) -> int | None:
        """:meth:`count` from the manifest's count of fewer of these parts (:data:`COUNT_OF`), when the table
        only gained parts since and that count was of unique keys too: it plus the added parts' keys that
        the others do not hold. One pass over the others' key columns, no de-duplication of them (an ingest
        adds a part of ``texts``: ~6M keys at 10^6 sessions, ~3.5 s to count again). None otherwise."""
        m = self.manifest
        known, of = (m.get("row_counts") or {}).get(name), (m.get(COUNT_OF) or {}).get(name)
        if not isinstance(known, int) or isinstance(known, bool) or known < 0 or not isinstance(of, list):
            return None
        now = dict(self.parts_digests(name, parts))
        if not all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and x[1] is not None
                   and now.get(x[0]) == x[1] for x in of):
            return None  # a part gone or rewritten since, or a record that is not one
        counted = {x[0] for x in of}
        old, added = [p for p in parts if p in counted], [p for p in parts if p not in counted]
        if not added or not self._counted_by_key(name, old):
            return None
        keys = list(KEYS[name])
        new = pa.chunked_array([_joined(self._read_part(name, p, keys), keys) for p in added], pa.string())
        if new.null_count:
            return None
        new = pc.unique(new.combine_chunks())
        held: list[pa.Array] = []
        for p in old:
            for _, batch in self.iter_groups(name, p, keys, batch_rows=1 << 16):
                mine = _joined(batch, keys)
                if mine.null_count:
                    return None
                held.append(mine.filter(pc.is_in(mine, value_set=new)))
        return known + len(new) - len(pc.unique(pa.chunked_array(held, pa.string()).combine_chunks()))

    def parts_key(self, name: str, parts: list[str] | None = None) -> str:
        """A digest of the table's parts and their recorded digests: the same key, the same rows."""
        return parts_key(self.parts_digests(name, parts))

    def parts_digests(self, name: str, parts: list[str] | None = None) -> list[list[str | None]]:
        """``[part, recorded digest]`` of each of ``parts`` (default: the table's), in their order."""
        chosen = self.parts(name) if parts is None else parts
        return [[p, self.part_digest(name, p)] for p in chosen]

    def disjoint(self, name: str, parts: list[str]) -> bool:
        """Whether ``parts`` are a large compacted part and the part merged beside it whose marker records
        that neither holds a key twice and no key is in both (:data:`DISJOINT_FROM`): then their metadata's
        rows are the unique keys, and no key need be read (seconds for the ``embeddings`` of 10^6 sessions,
        on every manifest update). Both are named by their bytes, so the record holds while both are there."""
        if len(parts) != 2 or not all(p.startswith(COMPACT_PREFIX) for p in parts):
            return False
        a, b = parts
        return any((self._part_marker(name, x) or {}).get(DISJOINT_FROM) == y
                   for x, y in ((a, b), (b, a)))

    def _tier(self, name: str, own: list[str], dim: int | None) -> _Tier | None:
        """The compacted part that :meth:`compact` leaves alone and what to leave out of the merge of the
        others, or None (merge everything)."""
        compacted = [p for p in own if p.startswith(COMPACT_PREFIX)]
        if not compacted or len(own) < 2:
            return None
        rows = {p: self._rows(name, p) for p in own}
        base = max(compacted, key=lambda p: (rows[p], p))
        if rows[base] < TIER_RATIO * sum(n for p, n in rows.items() if p != base):
            return None
        others = [p for p in own if p != base]
        scan = self._scan_base(name, base, others)
        if scan is None:
            return None
        if len(scan.repeated) and not self._repeats_equal(name, base, scan, self._merge_schema(name, others, dim)):
            return None
        covered = 0 < len(scan.repeated) == scan.keys
        return _Tier(base, scan.repeated, scan.base_unique, covered)

    def _scan_base(self, name: str, base: str, others: list[str]) -> _BaseScan | None:
        """One pass over the key columns of ``base`` (a batch at a time; the other parts' key columns are
        read whole: they are the small ones): which of the others' keys it holds too, where, and whether
        its keys strictly increase. None when a key is null (merge everything, as before)."""
        keys = list(KEYS[name])
        theirs = [_joined(self._read_part(name, p, keys), keys) for p in others]
        if any(k.null_count for k in theirs):
            return None
        wanted = pc.unique(pa.chunked_array(theirs, pa.string()))
        found: list[pa.Array] = []
        groups: list[int] = []
        last: pa.Scalar | None = None
        unique = True
        for group, batch in self.iter_groups(name, base, keys, batch_rows=1 << 16):
            mine = _joined(batch, keys)
            if mine.null_count:
                return None
            hit = pc.is_in(mine, value_set=wanted)
            if pc.any(hit).as_py():
                found.append(mine.filter(hit))
                if not groups or groups[-1] != group:
                    groups.append(group)
            unique = unique and _increasing(mine, last)
            last = mine[-1] if len(mine) else last
        repeated = pc.unique(pa.chunked_array(found, pa.string()))
        holders = [p for p, k in zip(others, theirs)
                   if len(repeated) and pc.any(pc.is_in(k, value_set=repeated)).as_py()]
        return _BaseScan(repeated, groups, holders, unique, len(wanted))

    def _repeats_equal(self, name: str, base: str, scan: _BaseScan, schema: pa.Schema) -> bool:
        """Whether every row of the other parts whose key ``base`` holds is ``base``'s row of that key, every
        column bit for bit, as the merge would write it (``schema``). Reads only the row groups of ``base``
        that hold such a key, and the other parts that do."""
        keys = list(KEYS[name])
        try:
            mine = self._rows_with(name, base, keys, scan.repeated, schema, scan.base_groups)
            theirs = pa.concat_tables([self._rows_with(name, p, keys, scan.repeated, schema) for p in scan.holders])
        except BankError:  # a part of another layout: the merge decides what it holds
            return False
        at = pc.index_in(_joined(theirs, keys), value_set=_joined(mine, keys))
        if at.null_count:
            return False
        mine = mine.take(at)
        return all(_same_bits(theirs.column(c).combine_chunks(), mine.column(c).combine_chunks())
                   for c in schema.names)

    def _rows_with(self, name: str, part: str, keys: list[str], wanted: pa.Array, schema: pa.Schema,
                   groups: list[int] | None = None) -> pa.Table:
        """The rows of ``part`` (of its row groups ``groups``, default all) whose key is in ``wanted``,
        conformed to ``schema`` (:class:`BankError` when they cannot be), read a batch at a time."""
        path = self._dir(name) / f"{part}.parquet"
        try:
            regular_file_size(path)  # a FIFO would block the reader for ever
            columns = pq.read_schema(path).names
        except (OSError, pa.ArrowException) as exc:
            raise self._unreadable(name, part, path, exc) from None
        found = [conform(t.filter(pc.is_in(_joined(t, keys), value_set=wanted)), schema, name)
                 for _, t in self.iter_groups(name, part, columns, batch_rows=1 << 16, groups=groups)]
        return pa.concat_tables(found) if found else schema.empty_table()

    def _merge_schema(self, name: str, own: list[str], dim: int | None) -> pa.Schema:
        """The schema :meth:`_compact_streamed` writes the merge of ``own`` in."""
        if name == "embeddings" and dim is None:  # the vectors' fixed size is the dimension
            dim = self._embeddings_dim(own[0], self._dir(name) / f"{own[0]}.parquet")
        return schema_for(name, dim)

    def _compact_streamed(self, name: str, own: list[str], dim: int | None, *, drop: pa.Array | None = None,
                          info: dict | None = None) -> int:
        """:meth:`compact` of a keyed table, merged in bounded memory (:mod:`memgas.pipeline.compaction`):
        the same rows, in the same order, as ``key_order`` of :meth:`read` written by :meth:`write`, less
        the keys ``drop`` (joined as :func:`_joined`); ``info``: more fields of the new part's marker."""
        d = self._dir(name)
        schema = self._merge_schema(name, own, dim)
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
                stream = _without_joined(without_keys(self.iter_merged(name, own), KEYS[name][0], held),
                                         list(KEYS[name]), drop)
                for group in regroup(stream, self._group_rows(name)):
                    writer.write_table(conform(group, schema, name), row_group_size=group.num_rows)
                    rows += group.num_rows
                    faults.hit("bank:compact:merging")  # scratch and temp file in place, nothing committed
                if rows == 0:
                    writer.write_table(schema.empty_table())
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._commit_file(name, Path(tmp), rows, own, info)
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
