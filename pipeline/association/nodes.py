"""Node vectors of one history: the [4*S, d] matrix (array, memmap or :class:`NodeFile`), its prefixes,
and the exact float64 rescoring of chosen candidates shared by every candidate search."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memgas.pipeline.config import AssociationConfig
from memgas.pipeline.schema import N_GRAN

# The library's defaults are the job's: one home for each value, the config (pipeline/config.py).
_DEFAULTS = AssociationConfig()
MEM_THRESHOLD: int = _DEFAULTS.mem_threshold
MIN_PRIOR_NODES: int = _DEFAULTS.min_prior_nodes


@dataclass
class Candidates:
    """Candidate rows of one history: row node ids, candidate ids [R, K] (best first), valid mask, scores."""

    rows: np.ndarray  # int64 [R]
    cand: np.ndarray  # int64 [R, K], -1 where invalid
    valid: np.ndarray  # bool [R, K]
    scores: np.ndarray  # float64 [R, K] (0 where invalid)


class ReadInBlocks:
    """A node matrix read a block of rows at a time, never whole (:class:`NodeFile`, and
    :class:`~memgas.pipeline.association.blocks.NodeBlocks`): the searches take it as it is."""


class NodeFile(ReadInBlocks):
    """Node vectors of one history in a ``.npy`` file (float32 [4*S, d]), read in blocks, never whole.

    Slices (``nf[a:b]``) read those rows from the file; an index array (``nf[idx]``) reads each run of
    consecutive ids with one ``pread`` (no memory map: see ``__getitem__``). Peak memory
    is then the blocks in flight, not the history: what lets a 10^6-session history (6 GB of float32
    vectors) be associated within a few GB. Supports ``shape``, ``dtype`` and ``len``, like an array.
    """

    def __init__(self, path: str | Path, n_nodes: int | None = None) -> None:
        self.path = Path(path)
        mm = np.load(self.path, mmap_mode="r")  # reads the header only; the map is dropped at once
        shape, dtype, fortran, self.offset = mm.shape, mm.dtype, not mm.flags.c_contiguous, int(mm.offset)
        del mm
        if fortran or np.dtype(dtype) != np.float32 or len(shape) != 2 or shape[0] % N_GRAN:
            raise ValueError(f"{self.path}: expected a C-order float32 [4*S, d] array, got {dtype} {shape}")
        n = int(shape[0]) if n_nodes is None else int(n_nodes)  # a prefix of the file: the history so far
        if not 0 <= n <= shape[0] or n % N_GRAN:
            raise ValueError(f"{self.path}: n_nodes={n_nodes} is not a whole-session prefix of {shape[0]} nodes")
        self.shape: tuple[int, int] = (n, int(shape[1]))
        self.dtype = np.dtype(np.float32)
        self._map: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_map": None}

    def __len__(self) -> int:
        return self.shape[0]

    def mapped(self) -> np.ndarray:
        """The rows as a read-only memory map, opened once and kept: for a scan that reads every row again and
        again (the similarities of each question, :mod:`memgas.pipeline.prepared`), where a ``pread`` per
        block would copy the file each time. Its pages are the page cache's (shared, clean: counted in RSS
        as file pages while mapped, never private memory). Scattered reads use ``[idx]`` instead (above)."""
        if self._map is None:
            self._map = np.memmap(self.path, np.float32, "r", self.offset, self.shape)
        return self._map

    def __getitem__(self, key: Any) -> np.ndarray:
        n, d = self.shape
        if isinstance(key, slice):
            a, b, step = key.indices(n)
            if step != 1:
                raise IndexError("NodeFile slices must have step 1")
            count = max(0, b - a)
            return np.fromfile(self.path, np.float32, count * d, offset=self.offset + 4 * a * d).reshape(count, d)
        idx = np.asarray(key, dtype=np.int64)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise IndexError(f"node index outside [0, {n})")
        # one pread per run of consecutive ids, not a memory map: each fault on a map brings its
        # neighbouring pages in too (fault-around, readahead) and they count in RSS while mapped, which
        # for candidates scattered over a 6 GB file was most of the file
        flat = idx.ravel()
        out = np.empty((flat.size, d), np.float32)
        order = np.argsort(flat, kind="stable")
        srt = flat[order]
        cuts = np.flatnonzero(np.diff(srt) != 1) + 1
        row = 4 * d
        with open(self.path, "rb") as f:
            fd = f.fileno()
            for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), srt.size]):
                buf = os.pread(fd, (b - a) * row, self.offset + int(srt[a]) * row)
                out[order[a:b]] = np.frombuffer(buf, np.float32).reshape(b - a, d)
        return out.reshape(*idx.shape, d)


def _as_nodes(emb_nodes: Any, whole_sessions: bool = True) -> Any:
    if isinstance(emb_nodes, ReadInBlocks):
        return emb_nodes
    e = np.asarray(emb_nodes)
    if e.ndim == 3:
        if e.shape[1] != N_GRAN:
            raise ValueError(f"emb_nodes [S, {N_GRAN}, d] expected, got {e.shape}")
        e = e.reshape(-1, e.shape[-1])
    if e.ndim != 2 or (whole_sessions and e.shape[0] % N_GRAN):
        raise ValueError(f"emb_nodes must be [{N_GRAN}*S, d] (or [S, {N_GRAN}, d]), got shape {e.shape}")
    return np.ascontiguousarray(e, dtype=np.float32)  # a float32 memmap stays a map (no copy)


def _first_row_session(n_sessions_done: int, min_prior_nodes: int) -> int:
    # session s is eligible when it has 4*s >= min_prior_nodes nodes before it
    return max(n_sessions_done, -(-min_prior_nodes // N_GRAN))


def _new_rows(n_nodes: int, index_ntotal: int, n_sessions_done: int, min_prior_nodes: int) -> np.ndarray:
    """The rows an approximate association computes next (the eligible rows of the sessions >=
    ``n_sessions_done``), after checking that its saved index holds exactly the sessions before them
    (or is empty: it is then filled, not searched, with them)."""
    if index_ntotal not in (0, N_GRAN * n_sessions_done):
        raise ValueError(f"the index holds {index_ntotal} nodes, not the {N_GRAN * n_sessions_done} of "
                         f"{n_sessions_done} sessions done")
    return np.arange(_first_row_session(n_sessions_done, min_prior_nodes) * N_GRAN, n_nodes, dtype=np.int64)


def _scores64(E: Any, rows: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """float64 dot products ``E[rows[r]] . E[cand[r, j]]`` of float32 vectors (exact products, float64 sums).

    Chunked so the gathered [chunk, K, d] block stays in cache and E is never copied whole; a row's
    scores do not depend on the chunk it falls in (einsum sums each entry the same way).
    """
    sc = np.empty(cand.shape)
    for a in range(0, rows.size, 256):
        c = cand[a : a + 256]
        u, inv = np.unique(c, return_inverse=True)  # sorted ids: sequential reads of a file or a map
        g = _read_rows(E, u).astype(np.float64)[inv.reshape(c.shape)]
        sc[a : a + 256] = np.einsum("rd,rkd->rk", _read_rows(E, rows[a : a + 256]).astype(np.float64), g)
    return sc


def _rescore(E: Any, rows: np.ndarray, cand: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, ...]:
    """float64 scores of the chosen candidates, then order best first (ties: lower node id)."""
    c = np.where(valid, cand, 0)
    sc = _scores64(E, rows, c)
    sc = np.where(valid, sc, -np.inf)
    # lexsort: primary -score, secondary candidate id (invalid entries sink to the end)
    idc = np.where(valid, cand, np.iinfo(np.int64).max)
    o = np.lexsort((idc, -sc), axis=1)
    cand = np.take_along_axis(cand, o, 1)
    valid = np.take_along_axis(valid, o, 1)
    sc = np.where(valid, np.take_along_axis(sc, o, 1), 0.0)
    return np.where(valid, cand, -1), valid, sc


def _read_rows(E: Any, idx: np.ndarray) -> np.ndarray:
    """float32 rows ``E[idx]`` (sorted ids) of an array, a memmap, a :class:`NodeFile` or a ``NodeBlocks``."""
    return np.ascontiguousarray(E[idx], dtype=np.float32)


def _read_cols(E: Any, c0: int, c1: int) -> np.ndarray:
    """float32 rows ``E[c0:c1]``, zero rows past the end of ``E`` (the padded tail of a column chunk)."""
    n = E.shape[0]
    block = np.ascontiguousarray(E[c0 : min(c1, n)], dtype=np.float32)
    if c1 <= n:
        return block
    out = np.zeros((c1 - c0, E.shape[1]), np.float32)
    out[: block.shape[0]] = block
    return out
