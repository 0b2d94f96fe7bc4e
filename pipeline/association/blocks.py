"""Node vectors of one history as fixed row blocks, fetched one block at a time: what a Ray task of the
associate stage gets instead of the history's matrix.

A :class:`NodeBlocks` holds a *handle* per block of ``block_rows`` rows (node ids ``[i*block_rows,
(i+1)*block_rows)``): an opaque reference that its ``fetch`` turns into the block (the job's executor shares
the block once and fetches it in the task when it reads those rows: this module knows nothing of how) or an
array-like read in place (an ndarray, or a :class:`NodeFile` the driver spilled the block to when it runs
the stage in-process). It reads like the node matrix
(``shape``, ``dtype``, slices, index arrays), so :func:`memgas.pipeline.association.exact_search.causal_rows`
takes it as it takes a :class:`NodeFile`: the causal search reads one column chunk and a group of query
tiles at a time, the exact rescoring 256 rows' candidates at a time, and every read here copies only the
rows asked for. The products, their shapes and so every bit of the result are those of the whole matrix
(the search's tiles and chunks are fixed by node ids, not by the blocks).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from memgas.pipeline.association.exact_search import COL_CHUNK
from memgas.pipeline.association.nodes import ReadInBlocks
from memgas.pipeline.schema import N_GRAN

#: rows per block (16,384 sessions; 96 MiB at d = 384): one column chunk of the causal search, so a chunk
#: is one block's rows. Any multiple of 4 gives the same bits (tests use tiny blocks).
BLOCK_ROWS = COL_CHUNK


class RowsNotShipped(LookupError):
    """A task read node rows its payload does not hold (a :class:`SparseBlock`'s other rows, or a block that
    was not shipped): the driver's list of the rows it needs was wrong. Never a silent zero."""


class SparseBlock:
    """Some rows of one node block: ``rows`` (sorted positions in the block) and their float32 vectors.
    What the driver ships of a block from which a task reads only a few rows (an IVF append reads the rows its
    new rows found, :func:`memgas.pipeline.association.ivf_search.ivf_found`, and no others); reading any
    other row, or a range, raises :class:`RowsNotShipped`."""

    def __init__(self, rows: np.ndarray, vectors: np.ndarray, block_rows: int) -> None:
        self.rows = np.asarray(rows, np.int64)
        self.vectors = np.asarray(vectors, np.float32)
        if self.vectors.ndim != 2 or self.vectors.shape[0] != self.rows.size:
            raise ValueError(f"{self.rows.size} rows with vectors of shape {self.vectors.shape}")
        self.shape: tuple[int, int] = (int(block_rows), int(self.vectors.shape[1]))

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, slice):
            raise RowsNotShipped(f"rows {key.start}:{key.stop} of a block of which only {self.rows.size} rows were "
                                 "shipped")
        idx = np.asarray(key, np.int64)
        pos = np.minimum(np.searchsorted(self.rows, idx), max(self.rows.size - 1, 0))
        ok = (self.rows[pos] == idx) if self.rows.size else np.zeros(idx.shape, bool)
        if not ok.all():
            raise RowsNotShipped(f"{int((~ok).sum())} node rows of a block were not shipped (first: row "
                                 f"{int(idx[~ok].ravel()[0])} of the block)")
        return self.vectors[pos]


class NodeBlocks(ReadInBlocks):
    """The first ``n_rows`` node vectors of one history (float32 ``[n_rows, dim]``) in blocks of
    ``block_rows`` rows. Only the last fetched block is kept; every read returns a new aligned, writeable
    float32 array (Ray's views are read-only and may be unaligned: NumPy would then skip BLAS and sum
    another way, see the job's ``owned`` in jobs/stages/shards.py). ``keep``: an object the handles need alive
    (the driver's spill directory); it is not pickled. ``fetch``: turns a handle into its block where it is
    read (a module-level function, pickled by name; None: every handle is read in place)."""

    def __init__(self, blocks: Sequence[Any], block_rows: int, n_rows: int, dim: int, keep: Any = None,
                 fetch: Callable[[Any], Any] | None = None) -> None:
        if block_rows <= 0 or block_rows % N_GRAN:
            raise ValueError(f"block_rows={block_rows} is not a positive multiple of {N_GRAN}")
        need = -(-n_rows // block_rows)
        if len(blocks) < need:
            raise ValueError(f"{len(blocks)} blocks of {block_rows} rows do not hold {n_rows} rows")
        self.blocks = list(blocks[:need])
        self.block_rows = int(block_rows)
        self.shape: tuple[int, int] = (int(n_rows), int(dim))
        self.dtype = np.dtype(np.float32)
        self.keep = keep
        self.fetch = fetch
        self._cached: tuple[int, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "keep": None, "_cached": None}

    def __len__(self) -> int:
        return self.shape[0]

    def _block(self, i: int) -> Any:
        """Block ``i`` (fetched from the object store once while it is the block being read)."""
        if self._cached is not None and self._cached[0] == i:
            return self._cached[1]
        h = self.blocks[i]
        if h is None:
            raise RowsNotShipped(f"node block {i} (rows {i * self.block_rows}-{(i + 1) * self.block_rows - 1}) was "
                                 "not shipped")
        if self.fetch is not None:
            h = self.fetch(h)
        want = min(self.block_rows, self.shape[0] - i * self.block_rows)
        if len(h.shape) != 2 or h.shape[0] < want or h.shape[1] != self.shape[1]:
            raise ValueError(f"node block {i}: shape {tuple(h.shape)}, expected at least [{want}, {self.shape[1]}]")
        self._cached = (i, h)
        return h

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, Any]]:
        """Rows ``[lo, hi)`` as ``(a, b, rows a..b)`` per block they span, without a copy where the handle
        allows: an array's view, Ray's zero-copy array (read-only), a :class:`NodeFile`'s kept memory map.
        For a reader that copies the rows anyway (the float64 similarities' buffer), so that they are copied
        once, not once more here. Threads may call this at once (the last fetched block is one reference,
        replaced whole)."""
        n, B = self.shape[0], self.block_rows
        if not 0 <= lo <= hi <= n:
            raise IndexError(f"rows [{lo}, {hi}) outside [0, {n})")
        out = []
        for i in range(lo // B, -(-hi // B)) if hi > lo else ():
            h = self.blocks[i]
            h = h.mapped() if hasattr(h, "mapped") else self._block(i)
            if isinstance(h, SparseBlock):
                raise RowsNotShipped(f"rows {lo}-{hi - 1}: node block {i} was shipped in part")  # Ray's: fetched once while it is read
            a, b = max(lo, i * B), min(hi, (i + 1) * B)
            if len(h.shape) != 2 or h.shape[0] < b - i * B or h.shape[1] != self.shape[1]:
                raise ValueError(f"node block {i}: shape {tuple(h.shape)}, expected at least "
                                 f"[{b - i * B}, {self.shape[1]}]")
            out.append((a, b, h[a - i * B : b - i * B]))
        return out

    def __getitem__(self, key: Any) -> np.ndarray:
        n, d = self.shape
        B = self.block_rows
        if isinstance(key, slice):
            a, b, step = key.indices(n)
            if step != 1:
                raise IndexError("NodeBlocks slices must have step 1")
            out = np.empty((max(0, b - a), d), np.float32)
            for i in range(a // B, -(-b // B)) if b > a else ():
                lo, hi = max(a, i * B), min(b, (i + 1) * B)
                out[lo - a : hi - a] = self._block(i)[lo - i * B : hi - i * B]
            return out
        idx = np.asarray(key, dtype=np.int64)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise IndexError(f"node index outside [0, {n})")
        flat = idx.ravel()
        out = np.empty((flat.size, d), np.float32)
        which = flat // B
        order = np.argsort(which, kind="stable")  # block by block, each fetched once per read
        cuts = np.flatnonzero(np.diff(which[order])) + 1
        for sel in np.split(order, cuts) if flat.size else ():
            i = int(which[sel[0]])
            out[sel] = self._block(i)[flat[sel] - i * B]
        return out.reshape(*idx.shape, d)
