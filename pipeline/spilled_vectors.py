"""The vectors of one long history, gathered from ``embeddings`` in ONE pass and spilled to a file.

The pass reads the newest part first and stops when every vector is found; in each part it reads the key
columns of only the row groups whose ``text_hash`` range (Parquet's row-group statistics) can hold a hash
still needed, then the vectors of only the row groups that hold one (:meth:`SpilledVectors._scan`). An
append's blocks then read the parts its encode wrote, not the large compacted part, and where a few texts
are only there (an appended text the bank had encoded before), the few row groups of its sorted key range.

A history longer than one node block (the job's block reader, jobs/history_index/block_reader.py) is read a block
of sessions at a time. Each block needs a few vectors out of the whole ``embeddings`` table, whose rows are in encode order,
not in the history's order, so a block's vectors can be anywhere in it: reading them per block scanned the
whole table once per block (a 10^5-session history: 7 scans of 0.9 GB, 40 s of an append's 80 s; 10^6
sessions: 61 scans of ~9 GB). :class:`SpilledVectors` scans the table once, keeps the rows the history
needs and writes each at its own slot of a float32 file (slots: the needed hashes per encoder key, sorted),
so a block's vectors are then read from that file, at the rows it asks for.

The file is unlinked as soon as it is open (its descriptor keeps it): nothing is left on disk when the process
ends, closed or killed (a SIGKILL used to leave ``memgas-vectors-*`` directories of gigabytes behind). A write
that finds the disk full says which directory and how much it needs (``TMPDIR`` picks it).

Memory: one batch of the table, the sorted needed hashes (fixed-width bytes, 32 a text hash) and a flag per
slot, never the history's matrix: the file is written and read with ``pwrite`` / ``pread``, not through a
mapping (a mapping's pages count in the process's RSS, and the kernel maps pages around each one touched,
so scattered rows would have mapped most of the file). Disk: the needed vectors once (``4 * d`` bytes
each), in a file that lives as long as the object (the caller's) and its process.

The rows kept are those :meth:`memgas.pipeline.bank.Bank.read` would return: every completed part in part
order, a later row of a (text hash, encoder) winning over an earlier one.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memgas.pipeline.bank import Bank
from memgas.pipeline.errors import BankError
from memgas.pipeline.hashing import regular_file_size

#: rows per batch of the one pass over ``embeddings`` (12 MiB of vectors at d = 384)
SCAN_BATCH_ROWS = 8192


def fixed_hashes(hashes: pa.Array | pa.ChunkedArray, width: int) -> np.ndarray:
    """``hashes`` (strings of at most ``width`` bytes) as a NumPy ``S<width>`` array. When every one has
    ``width`` bytes (text hashes do: 32 hex digits), through Arrow without a Python string per row."""
    arr = hashes.combine_chunks() if isinstance(hashes, pa.ChunkedArray) else hashes
    if len(arr) == 0:
        return np.zeros(0, f"S{width}")
    if pc.all(pc.equal(pc.binary_length(arr), width)).as_py():
        fixed = arr.cast(pa.binary(width))
        return np.frombuffer(fixed.buffers()[1], f"S{width}", count=len(fixed), offset=fixed.offset * width).copy()
    # other ids (tests' banks name texts freely): NumPy pads with NULs, which no text hash holds. A chunk of
    # Python strings at a time (a history's millions of ids at once would be ~60 bytes each)
    out = np.empty(len(arr), f"S{width}")
    for a in range(0, len(arr), 65536):
        out[a : a + 65536] = [h.encode("utf-8") for h in arr.slice(a, 65536).to_pylist()]
    return out


class SpilledVectors:
    """The vectors of ``need`` (text hashes per encoder key), read from ``bank``'s ``embeddings`` in one pass."""

    def __init__(self, bank: Bank, need: Mapping[str, Iterable[str] | pa.Array | pa.ChunkedArray],
                 directory: str | Path | None = None, extra: Sequence[str] = ()) -> None:
        """``extra``: other (scalar) columns of ``embeddings`` to keep per slot, for :meth:`sorted_tables`."""
        self.bank = bank
        self.extra = tuple(extra)
        self._extra: dict[str, list] = {}  # column -> [values, valid] per slot, and its Arrow type
        self.directory = directory
        self.path: Path | None = None  # the spill file's name while it was being opened (unlinked since)
        self._keys: dict[str, tuple[np.ndarray, int]] = {}  # key -> (its sorted hashes, its first slot)
        arrays = {k: v if isinstance(v, (pa.Array, pa.ChunkedArray)) else pa.array(sorted(set(v)), pa.string())
                  for k, v in need.items()}
        self.width = max([int(pc.max(pc.binary_length(a)).as_py()) for a in arrays.values() if len(a)], default=1)
        slots = 0
        for key in sorted(arrays):
            hashes = np.unique(fixed_hashes(arrays[key], self.width))
            self._keys[key] = (hashes, slots)
            slots += hashes.size
        self.slots = slots
        self.dim = 0
        self._fd: int | None = None
        self._filled = np.zeros(slots, bool)
        if slots:
            self._scan()

    def _keep_extra(self, slots: np.ndarray, rows: pa.Table) -> None:
        for c in self.extra:
            col = rows[c].combine_chunks()
            if c not in self._extra:
                dtype = np.bool_ if pa.types.is_boolean(col.type) else col.type.to_pandas_dtype()
                self._extra[c] = [np.zeros(self.slots, dtype), np.zeros(self.slots, bool), col.type]
            values, valid, _ = self._extra[c]
            ok = col.is_valid().to_numpy(zero_copy_only=False)
            values[slots[ok]] = col.filter(col.is_valid()).to_numpy(zero_copy_only=False)
            valid[slots] = ok

    def sorted_tables(self, chunk_rows: int) -> Iterator[pa.Table]:
        """The gathered rows in (encoder key, text hash) order, ``chunk_rows`` at a time: columns
        ``text_hash``, ``encoder``, ``vector`` and the ``extra`` ones (what :meth:`Bank.read` gives for them,
        sorted), one chunk in memory at a time."""
        for key in sorted(self._keys):
            hashes, first = self._keys[key]
            filled = np.flatnonzero(self._filled[first:first + hashes.size])
            for a in range(0, filled.size, chunk_rows):
                pos = filled[a:a + chunk_rows]
                slots = first + pos
                vectors = self._gather(slots)
                cols = {"text_hash": pa.array(np.char.decode(hashes[pos], "utf-8").tolist(), pa.string()),
                        "encoder": pa.array([key] * pos.size, pa.string()),
                        "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel(), pa.float32()), self.dim)}
                for c in self.extra:
                    values, valid, typ = self._extra[c]
                    cols[c] = pa.array(values[slots], typ, mask=~valid[slots])
                yield pa.table(cols)

    def _scan(self) -> None:
        """Newest part first: a part's rows win over every earlier part's, so a slot a later part filled is
        final, and once every slot is filled the earlier parts are not read (after an append, the new texts'
        vectors are in the parts the append's encode wrote beside the large compacted part). Within a part,
        the narrow key columns are read first and the vectors only of the row groups that hold a slot still
        open. The rows kept are those of one pass in part order, a later row winning."""
        columns = ["text_hash", "encoder", "vector", *self.extra]
        final = np.zeros(self.slots, bool)  # filled by a part later than the one being read
        for part in reversed(self.bank.parts("embeddings")):
            if final.all():
                break
            maybe = self._groups_in_range(part, final)
            if maybe == []:
                continue
            groups = sorted({g for g, t in self.bank.iter_groups("embeddings", part, ["text_hash", "encoder"],
                                                                 batch_rows=SCAN_BATCH_ROWS, groups=maybe)
                             if self._matches(t, final)[0].size})
            if groups:
                for _, t in self.bank.iter_groups("embeddings", part, columns, batch_rows=SCAN_BATCH_ROWS,
                                                  groups=groups):
                    slots, rows = self._matches(t, final)
                    if slots.size:
                        self._write(slots, rows["vector"].combine_chunks())
                        if self.extra:
                            self._keep_extra(slots, rows)
            final = self._filled.copy()

    def _groups_in_range(self, part: str, final: np.ndarray) -> list[int] | None:
        """The row groups of ``part`` whose ``text_hash`` statistics (min, max) can hold a hash whose slot is
        not ``final``, ascending; None: every group (no statistics to go by). A compacted part is sorted by
        key, so its groups' ranges are narrow and disjoint: a few hashes are in a few groups. The rows of the
        groups passed by hold no needed hash, so the rows kept are the same."""
        ranges = key_ranges(self.bank, part)
        if ranges is None:
            return None
        open_ = np.unique(np.concatenate([hashes[~final[first : first + hashes.size]]
                                          for hashes, first in self._keys.values()] or [np.zeros(0, f"S{self.width}")]))
        known = [g for g, r in enumerate(ranges) if r is not None]
        lo = np.array([ranges[g][0][: self.width] for g in known], f"S{self.width}")
        # a hash of at most ``width`` bytes is <= max exactly when it is <= max's first ``width`` bytes; the
        # shortened min is <= min, so a group is only ever kept in excess
        hi = np.array([ranges[g][1][: self.width] for g in known], f"S{self.width}")
        hit = np.searchsorted(open_, lo, side="left") < np.searchsorted(open_, hi, side="right")
        keep = {g for g, h in zip(known, hit.tolist()) if h} | {g for g, r in enumerate(ranges) if r is None}
        return sorted(keep)

    def _matches(self, t: pa.Table, final: np.ndarray) -> tuple[np.ndarray, pa.Table]:
        """The slots of the rows of ``t`` that are needed and not ``final``, and those rows (in table order)."""
        t = t.filter(pc.less_equal(pc.binary_length(t["text_hash"]), self.width))  # longer: never needed
        slots, rows = [], []
        for key, (hashes, first) in self._keys.items():
            mine = t.filter(pc.equal(t["encoder"], key))
            if mine.num_rows == 0 or hashes.size == 0:
                continue
            got = fixed_hashes(mine["text_hash"], self.width)
            pos = np.minimum(np.searchsorted(hashes, got), hashes.size - 1)
            hit = hashes[pos] == got
            hit[hit] = ~final[first + pos[hit]]
            if hit.any():
                slots.append(first + pos[hit])
                rows.append(mine.filter(pa.array(hit)))
        if not slots:
            return np.zeros(0, np.int64), t.slice(0, 0)
        return np.concatenate(slots), pa.concat_tables(rows) if len(rows) > 1 else rows[0]

    def _write(self, slots: np.ndarray, vectors: pa.FixedSizeListArray) -> None:
        d = vectors.type.list_size
        if not self.dim:
            self.dim = d
            fd, name = tempfile.mkstemp(prefix="memgas-vectors-", suffix=".f32", dir=self.directory)
            os.unlink(name)  # the descriptor keeps the file until it is closed, or the process ends
            self._fd, self.path = fd, Path(name)
        elif d != self.dim:
            raise BankError(f"{self.bank.path}: embeddings of {d} and {self.dim} dimensions under one history")
        rows = vectors.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(-1, d)
        # in table order, so that a later row of the same slot wins (as in Bank.read); runs of consecutive
        # slots in one call each
        for a, b in _runs(slots):
            try:
                os.pwrite(self._fd, rows[a:b].tobytes(), int(slots[a]) * 4 * d)
            except OSError as e:
                where = self.path.parent if self.path else tempfile.gettempdir()
                raise OSError(e.errno, f"spilling a long history's vectors to {where}: {e.strerror}; it needs "
                                       f"{self.slots * 4 * d / 2**30:.2f} GiB there (set TMPDIR to a larger "
                                       f"disk)") from e
        self._filled[slots] = True

    def read(self, key: str, hashes: Iterable[str]) -> tuple[np.ndarray, dict[str, int]]:
        """float32 ``[n, d]`` vectors of ``hashes`` (distinct) under ``key`` and the row of each hash: what
        :meth:`memgas.pipeline.granularity.MatrixLoader._read` returns; every one must have been needed and
        found."""
        order = sorted(set(hashes))
        slots = self.slots_of(key, np.array([h.encode("utf-8") for h in order], dtype=object))
        if not order:
            return np.zeros((0, self.dim), np.float32), {}
        return self._gather(slots), {h: i for i, h in enumerate(order)}

    def slots_of(self, key: str, hashes: np.ndarray) -> np.ndarray:
        """The slot (row of the spill file) of each of ``hashes`` (UTF-8 bytes: a fixed-width ``S`` array or
        objects; any order, repeats allowed) under ``key``; every one must have been needed and found."""
        if key not in self._keys:
            raise BankError(f"{self.bank.path}: no '{key}' embeddings were gathered for this history")
        table, first = self._keys[key]
        too_long = [h for h in hashes.tolist() if len(h) > self.width] if hashes.dtype == object else []
        if too_long:
            raise BankError(f"{self.bank.path}: no '{key}' embedding of text_hash {too_long[0].decode()} was gathered")
        want = hashes.astype(f"S{self.width}")
        pos = np.minimum(np.searchsorted(table, want), max(table.size - 1, 0))
        known = (table[pos] == want) if table.size else np.zeros(len(want), bool)
        ok = known.copy()
        ok[known] = self._filled[first + pos[known]]
        if not ok.all():
            absent = want[int(np.flatnonzero(~ok)[0])].decode("utf-8")
            raise BankError(f"{self.bank.path}: {int((~ok).sum())} texts have no '{key}' embedding (first "
                            f"text_hash {absent}); run `memgas index` with this config (its encode stage)")
        return first + pos

    def vectors_at(self, slots: np.ndarray) -> np.ndarray:
        """float32 ``[len(slots), d]``: the vectors at ``slots`` (from :meth:`slots_of`)."""
        return self._gather(np.asarray(slots, np.int64))

    def _gather(self, slots: np.ndarray) -> np.ndarray:
        """float32 ``[len(slots), d]``: the vectors at ``slots``, one ``pread`` per run of consecutive slots."""
        vectors = np.empty((slots.size, self.dim), np.float32)
        row_bytes = 4 * self.dim
        for a, b in _runs(slots):
            got = os.pread(self._fd, (b - a) * row_bytes, int(slots[a]) * row_bytes)
            vectors[a:b] = np.frombuffer(got, np.float32).reshape(b - a, self.dim)
        return vectors

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None


def key_ranges(bank: Bank, part: str, column: str = "text_hash") -> list[tuple[bytes, bytes] | None] | None:
    """Per row group of ``embeddings`` part ``part``, the (min, max) of ``column`` in its Parquet statistics
    as UTF-8 bytes (None for a group without them: not written, or values too long for them); None when
    the part's footer cannot be read (the scan that follows reads the part and says why)."""
    path = bank._dir("embeddings") / f"{part}.parquet"
    try:
        regular_file_size(path)  # a FIFO would block the reader for ever
        meta = pq.ParquetFile(path).metadata
    except (OSError, pa.ArrowException):
        return None
    if meta.num_row_groups == 0:
        return []
    first = meta.row_group(0)
    at = [j for j in range(first.num_columns) if first.column(j).path_in_schema == column]
    if not at:
        return None
    out: list[tuple[bytes, bytes] | None] = []
    for g in range(meta.num_row_groups):
        st = meta.row_group(g).column(at[0]).statistics
        if st is None or not st.has_min_max:
            out.append(None)
            continue
        out.append(tuple(v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in (st.min, st.max)))
    return out


def _runs(slots: np.ndarray) -> list[tuple[int, int]]:
    """``[a, b)`` position ranges of ``slots`` whose slots follow one another (``slots[i+1] == slots[i]+1``)."""
    if slots.size == 0:
        return []
    cut = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate([[0], cut]).tolist()
    return list(zip(starts, [*cut.tolist(), int(slots.size)]))
