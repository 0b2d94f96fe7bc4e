"""Association graph of one history (MemGAS step 3), batched.

Nodes are ordered session_1{session, turn, summary, keyword}, session_2{...}: node id = 4*session_pos + g
with g = 0 session, 1 turn, 2 summary, 3 keyword. For every node of a session with at least
``min_prior_nodes`` nodes before it (i.e. 4*s >= min_prior_nodes), the candidates are the nodes of strictly
earlier sessions; we keep the top ``mem_threshold`` by dot-product similarity (best first, ties by lower
node id), fit the batched 2-component GMM (``memgas.kernels.gmm``) to their scores and add an undirected
edge (node, candidate) for each candidate in the higher-mean component.

Edges are stored once as (src, dst) with src > dst (src = the later node, dst = the earlier candidate).
Because candidates come only from strictly earlier sessions, the same unordered pair can arise only from
the later node's row: no pair is produced twice, so no dedup is needed.

Exactness notes:
- candidate search runs on float32 (dense matmul or faiss); the chosen candidates are then rescored in
  float64 (dot products of the float32 embeddings), and these scores order the candidates and feed the
  GMM. So the dense and faiss paths give identical edges unless two candidates tie within float32
  rounding at the mem_threshold boundary.
- ``mode="topk"`` (ablation "MemGAS w/o GMM"): keep the ``topk_edges`` best candidates of each eligible row
  instead of the GMM-accepted ones. ``topk_edges=None`` (default) = the GMM's mean accepted count over the
  same rows, rounded (12.7 -> 13 on LoCoMo with MiniLM), so the ablation changes *which* edges, not how many.
- incremental: ``associate(emb, n_sessions_done=k)`` computes only rows of sessions >= k (cost
  O(new x history)); concatenating its outputs equals one build over all sessions.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from memgas.kernels.backend import get_xp, to_host
from memgas.kernels.gmm import fit_gmm_1d
from memgas.kernels.topk import topk

log = logging.getLogger(__name__)

N_GRAN = 4
DENSE_MAX_NODES = 20_000  # above this many nodes, candidate search goes through faiss
SMALL_HISTORY_NODES = 1024  # at or below this many nodes per history, CPU search uses 1 BLAS thread
ROW_CHUNK = 4096  # query rows per dense similarity block (bounds memory to ROW_CHUNK x n_nodes floats)
#: sessions per row block of the causal search (64 sessions = 256 rows: a 256 x prefix float32 block)
CAUSAL_BLOCK_SESSIONS = 64
#: prefix columns per product in the causal search (bounds a block to 256 x 65536 float32 = 64 MB)
COL_CHUNK = 1 << 16
#: column counts of the causal search's products are padded to a multiple of this (canonical shapes)
COL_PAD = 64
#: rows per batched GMM fit (bounds its temporaries on huge histories; the result is the same)
GMM_ROWS = 1 << 16
#: query tiles held at once by the causal search (each column chunk is read once per group)
GROUP_TILES = 64


@dataclass
class Edges:
    """Undirected edges of one history, stored once (src > dst)."""

    src: np.ndarray  # int64 [E]
    dst: np.ndarray  # int64 [E]
    sim: np.ndarray  # float32 [E]

    @staticmethod
    def empty() -> "Edges":
        return Edges(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))


@dataclass
class Candidates:
    """Candidate rows of one history: row node ids, candidate ids [R, K] (best first), valid mask, scores."""

    rows: np.ndarray  # int64 [R]
    cand: np.ndarray  # int64 [R, K], -1 where invalid
    valid: np.ndarray  # bool [R, K]
    scores: np.ndarray  # float64 [R, K] (0 where invalid)


class NodeFile:
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

    def __len__(self) -> int:
        return self.shape[0]

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
    if isinstance(emb_nodes, NodeFile):
        return emb_nodes
    e = np.asarray(emb_nodes)
    if e.ndim == 3:
        if e.shape[1] != N_GRAN:
            raise ValueError(f"emb_nodes [S, 4, d] expected, got {e.shape}")
        e = e.reshape(-1, e.shape[-1])
    if e.ndim != 2 or (whole_sessions and e.shape[0] % N_GRAN):
        raise ValueError(f"emb_nodes must be [4*S, d] (or [S, 4, d]), got shape {e.shape}")
    return np.ascontiguousarray(e, dtype=np.float32)  # a float32 memmap stays a map (no copy)


def _first_row_session(n_sessions_done: int, min_prior_nodes: int) -> int:
    # session s is eligible when it has 4*s >= min_prior_nodes nodes before it
    return max(n_sessions_done, -(-min_prior_nodes // N_GRAN))


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


def _dense_candidates(E: np.ndarray, rows: np.ndarray, k: int, device: str) -> tuple[np.ndarray, np.ndarray]:
    """Top-k earlier-session candidates per row: the full masked [rows, nodes] matrix + one top-k.

    The reference for :func:`_causal_candidates` (tests check they agree); also what ``search="dense"``
    ran before the blocked version.
    """
    xp, _ = get_xp(device)
    R = rows.size
    cand = np.full((R, k), -1, np.int64)
    valid = np.zeros((R, k), bool)
    if R == 0:
        return cand, valid
    limit_all = (rows // N_GRAN) * N_GRAN  # nodes before the row's session
    Ed = xp.asarray(E)
    for a in range(0, R, ROW_CHUNK):
        r = rows[a : a + ROW_CHUNK]
        lim = limit_all[a : a + ROW_CHUNK]
        ncol = int(lim.max())
        if ncol == 0:
            continue
        sims = Ed[xp.asarray(r)] @ Ed[:ncol].T  # float32 [chunk, ncol]
        colmask = xp.arange(ncol)[None, :] < xp.asarray(lim)[:, None]
        sims = xp.where(colmask, sims, -xp.inf)
        kk = min(k, ncol)
        idx, val = topk(sims, kk)
        idx, val = to_host(idx), to_host(val)
        ok = np.isfinite(val)
        cand[a : a + r.size, :kk] = np.where(ok, idx, -1)
        valid[a : a + r.size, :kk] = ok
    return cand, valid


def _topk_rows(sims: Any, k: int) -> tuple[Any, Any]:
    """Top ``k`` per row, best first, ties by lower column: same result as ``kernels.topk.topk``, fewer passes.

    One ``argpartition`` picks k largest entries per row; one equality count finds the rows where an
    entry left out ties the k-th value (float ties, or -inf padding of short prefixes): only those rows go
    through the exact tie-aware ``topk``. The k picked entries are then ordered by (-score, column).
    """
    xp = get_xp("cuda")[0] if type(sims).__module__.startswith("cupy") else np
    n = sims.shape[1]
    k = min(k, n)
    if k == n:
        return topk(sims, k)
    part = xp.argpartition(sims, n - k, axis=1)[:, n - k :]  # the k largest, unordered
    part = xp.sort(part, axis=1)  # column order, so a stable sort by score keeps lower columns first on ties
    pv = xp.take_along_axis(sims, part, 1)
    kth = pv.min(axis=1, keepdims=True)
    bad = (sims == kth).sum(axis=1) != (pv == kth).sum(axis=1)
    o = xp.argsort(-pv, axis=1, kind="stable") if xp is np else xp.argsort(-pv, axis=1)
    idx = xp.take_along_axis(part, o, 1).astype(xp.int64)
    val = xp.take_along_axis(pv, o, 1)
    if bool(bad.any()):
        sel = xp.nonzero(bad)[0]
        bi, bv = topk(sims[sel], k)
        idx[sel], val[sel] = bi, bv
    return idx, val


def _pad(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`COL_PAD` (at least one multiple)."""
    return max(COL_PAD, -(-n // COL_PAD) * COL_PAD)


def _read_rows(E: Any, idx: np.ndarray) -> np.ndarray:
    """float32 rows ``E[idx]`` (sorted ids) of an array, a memmap or a :class:`NodeFile`."""
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


def _causal_candidates(
    E: Any, rows: np.ndarray, k: int, device: str, block_sessions: int = CAUSAL_BLOCK_SESSIONS,
    col_chunk: int = COL_CHUNK, group_tiles: int = GROUP_TILES,
) -> tuple[np.ndarray, np.ndarray]:
    """Blocked causal top-k: the same candidates as :func:`_dense_candidates` at about half the work.

    Rows are taken in tiles of ``block_sessions`` sessions on a grid fixed by node ids (tile t = sessions
    [t*block_sessions, (t+1)*block_sessions)). A tile's rows can only see nodes before their own session,
    so each tile multiplies against its *prefix* (the lower triangle of the similarity matrix, never the
    upper one), masks the small in-tile triangle, and takes one top-k per column chunk, merged chunk by
    chunk (earlier chunks first, so equal scores keep the lower node id).

    Every product has a canonical shape: the query block is the whole tile (``4*block_sessions`` rows,
    zero rows where a row is not asked for, each row at its own place in the tile) and the column count
    is padded to a multiple of :data:`COL_PAD`. BLAS gives an entry different low bits depending on the
    product's shape (small products take other kernels), so without this a row's float32 scores, and at
    near-ties its candidates, would depend on which other rows were asked for in the same call. With it a
    row's candidates are the same whatever the row set: one call over a history, its row blocks
    (:func:`causal_rows`, one Ray task each) and the rows of appended sessions agree byte for byte.

    ``E`` may be an array, a ``np.memmap`` or a :class:`NodeFile` (read in blocks: only one column chunk
    and ``group_tiles`` query tiles are in memory at a time). Written against ``xp``: NumPy on CPU, CuPy
    on GPU (the GPU candidate search; there is no GPU faiss path).
    """
    xp, _ = get_xp(device)
    R = rows.size
    cand = np.full((R, k), -1, np.int64)
    valid = np.zeros((R, k), bool)
    if R == 0:
        return cand, valid
    T = block_sessions * N_GRAN  # rows of a full tile
    row_sess = rows // N_GRAN
    tile = row_sess // block_sessions
    # rows are sorted (node order): cut them where the tile changes
    cuts = np.flatnonzero(np.diff(tile)) + 1
    starts = np.concatenate([[0], cuts]).tolist()
    ends = np.concatenate([cuts, [R]]).tolist()
    for g in range(0, len(starts), group_tiles):
        tiles = []
        for a, b in zip(starts[g : g + group_tiles], ends[g : g + group_tiles]):
            lim_h = row_sess[a:b] * N_GRAN  # nodes before each row's session
            ncol = int(lim_h.max())
            if ncol == 0:
                continue
            q = np.zeros((T, E.shape[1]), np.float32)
            slot = rows[a:b] - int(tile[a]) * T  # each row at its own place in the tile
            q[slot] = _read_rows(E, rows[a:b])
            tiles.append({"a": a, "b": b, "q": xp.asarray(q), "slot": xp.asarray(slot), "ncol": ncol,
                          "lo": int(lim_h.min()), "lim": xp.asarray(lim_h)[:, None], "i": None, "v": None})
        if not tiles:
            continue
        top = max(t["ncol"] for t in tiles)
        # column chunks outside, tiles inside: each chunk of the prefix is read once per group of tiles
        for c0 in range(0, top, col_chunk):
            c1g = min(top, c0 + col_chunk)
            chunk = xp.asarray(_read_cols(E, c0, c0 + _pad(c1g - c0)))
            for t in tiles:
                if t["ncol"] <= c0:
                    continue
                c1 = min(t["ncol"], c0 + col_chunk)
                w = _pad(c1 - c0)
                sims = (t["q"] @ chunk[:w].T)[t["slot"]]  # float32 [tile rows, w]: canonical product shape
                if c0 + w > min(t["lo"], c1):  # the in-tile triangle and the padding: columns not to see
                    m0 = max(min(t["lo"], c1), c0)
                    cols = xp.arange(m0, c0 + w)[None, :]
                    tail = (cols < t["lim"]) & (cols < c1)
                    sims[:, m0 - c0 :] = xp.where(tail, sims[:, m0 - c0 :], -xp.inf)
                i, v = _topk_rows(sims, k)
                i = i + c0
                if t["i"] is not None:
                    i2, v2 = xp.concatenate([t["i"], i], 1), xp.concatenate([t["v"], v], 1)
                    j, v = _topk_rows(v2, k)
                    i = xp.take_along_axis(i2, j, 1)
                t["i"], t["v"] = i, v
            del chunk
        for t in tiles:
            idx, val = to_host(t["i"]), to_host(t["v"])
            a, b, kk = t["a"], t["b"], idx.shape[1]
            ok = np.isfinite(val)
            cand[a:b, :kk] = np.where(ok, idx, -1)
            valid[a:b, :kk] = ok
    return cand, valid


def _faiss_candidates(
    E: np.ndarray, rows: np.ndarray, k: int, device: str, block_sessions: int = 1024
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k earlier-session candidates via faiss IndexFlatIP, built progressively.

    Sessions are processed in blocks [a, b): the block's rows search an index holding the nodes of
    sessions < a; candidates inside the block (earlier sessions of the same block) come from a small
    dense block x block product; the two lists are merged by score. The index then receives the block.
    """
    import faiss  # noqa: PLC0415

    d = E.shape[1]
    index = faiss.IndexFlatIP(d)
    if device in ("cuda", "auto") and hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
        res = faiss.StandardGpuResources()
        index = faiss.index_cpu_to_gpu(res, 0, index)
    elif device == "cuda":
        log.warning("faiss has no GPU support here; association candidate search runs on CPU")
    R = rows.size
    cand = np.full((R, k), -1, np.int64)
    valid = np.zeros((R, k), bool)
    n_sessions = E.shape[0] // N_GRAN
    row_sess = rows // N_GRAN
    for a in range(0, n_sessions, block_sessions):
        b = min(n_sessions, a + block_sessions)
        sel = np.nonzero((row_sess >= a) & (row_sess < b))[0]
        if sel.size:
            r = rows[sel]
            q = E[r]
            parts_i, parts_v = [], []
            if index.ntotal:
                v, i = index.search(q, min(k, index.ntotal))
                parts_i.append(i.astype(np.int64))
                parts_v.append(np.where(i >= 0, v, -np.inf).astype(np.float32))
            # within-block earlier sessions
            lo = a * N_GRAN
            blk = E[lo : b * N_GRAN]
            s_in = q @ blk.T
            lim = (row_sess[sel] * N_GRAN - lo)[:, None]
            s_in = np.where(np.arange(blk.shape[0])[None, :] < lim, s_in, -np.inf).astype(np.float32)
            kk = min(k, blk.shape[0])
            ii, vv = topk(s_in, kk)
            parts_i.append(ii + lo)
            parts_v.append(vv)
            allv = np.concatenate(parts_v, 1)
            alli = np.concatenate(parts_i, 1)
            # ties by lower node id: sort by (-score, id)
            o = np.lexsort((alli, -allv), axis=1)[:, :k]
            ci = np.take_along_axis(alli, o, 1)
            cv = np.take_along_axis(allv, o, 1)
            ok = np.isfinite(cv) & (ci >= 0)
            cand[sel, : ci.shape[1]] = np.where(ok, ci, -1)
            valid[sel, : ci.shape[1]] = ok
        index.add(E[a * N_GRAN : b * N_GRAN])
    return cand, valid


def causal_rows(
    emb_nodes: Any, a: int, b: int, *, mem_threshold: int = 30, min_prior_nodes: int = 20, device: str = "cpu",
    block_sessions: int = CAUSAL_BLOCK_SESSIONS, col_chunk: int = COL_CHUNK,
) -> Candidates:
    """Exact causal candidates of the rows (node ids) ``[a, b)`` of one history: one Ray task's share.

    ``emb_nodes`` holds at least the nodes ``[0, b)`` (the prefix those rows may see and the rows
    themselves; more is fine and never read): an array, a ``np.memmap`` or a :class:`NodeFile` (read in
    blocks). Rows before the first eligible session (``min_prior_nodes``) give no candidates. The result
    is byte for byte the rows' part of ``candidates(..., search="causal")`` over the whole history,
    whatever ``a`` and ``b`` (see :func:`_causal_candidates` for why), so a history split into blocks, or
    extended by appended sessions, gives the same candidates, scores and edges as one task.
    """
    E = _as_nodes(emb_nodes, whole_sessions=False)  # a prefix may end inside the last row's session
    if not 0 <= a <= b <= E.shape[0]:
        raise ValueError(f"rows [{a}, {b}) outside the {E.shape[0]} nodes given")
    first = _first_row_session(0, min_prior_nodes) * N_GRAN
    rows = np.arange(max(a, first), b, dtype=np.int64)
    cand, valid = _causal_candidates(E, rows, int(mem_threshold), device, block_sessions, col_chunk)
    cand, valid, sc = _rescore(E, rows, cand, valid)
    return Candidates(rows, cand, valid, sc)


def associate_rows(
    emb_nodes: Any, a: int, b: int, *, mem_threshold: int = 30, min_prior_nodes: int = 20, mode: str = "gmm",
    topk_edges: int | None = None, device: str = "cpu", block_sessions: int = CAUSAL_BLOCK_SESSIONS,
    col_chunk: int = COL_CHUNK,
) -> Edges:
    """Edges contributed by the rows ``[a, b)`` of one history (exact causal search, then the GMM accept).

    Concatenating the edges of consecutive blocks that cover ``[0, 4*S)`` gives exactly
    ``associate(emb, search="causal")`` (the GMM fits each row alone). ``mode="topk"`` needs an explicit
    ``topk_edges``: its default (the mean accepted count over *all* rows) is not known to one block.
    """
    if mode == "topk" and topk_edges is None:
        raise ValueError("associate_rows(mode='topk') needs topk_edges (the all-rows mean is not local to a block)")
    c = causal_rows(emb_nodes, a, b, mem_threshold=mem_threshold, min_prior_nodes=min_prior_nodes,
                    device=device, block_sessions=block_sessions, col_chunk=col_chunk)
    return _edges(c, _accept([c], mode, topk_edges, device)[0])


def split_rows(n_nodes: int, parts: int, *, start: int = 0, block_sessions: int = CAUSAL_BLOCK_SESSIONS) -> list[tuple[int, int]]:
    """Cut the rows ``[start, n_nodes)`` into about ``parts`` blocks of about equal causal work.

    A row's work grows with its prefix, so equal work means blocks that shrink towards the end (cut at
    equal steps of ``r^2``). Cuts fall on tile edges (``4*block_sessions`` rows), so no tile's product
    is computed by two tasks; the result does not depend on the cuts either way.
    """
    if n_nodes <= start or parts < 1:
        return []
    T = block_sessions * N_GRAN
    cuts = {start, n_nodes}
    for j in range(1, parts):
        r = int(np.sqrt(start**2 + (n_nodes**2 - start**2) * j / parts))
        r = (r // T) * T
        if start < r < n_nodes:
            cuts.add(r)
    c = sorted(cuts)
    return list(zip(c[:-1], c[1:]))


@dataclass(frozen=True)
class HNSWParams:
    """Approximate causal search (faiss HNSW). ``store``: how the index keeps vectors: "flat" (float32),
    "fp16" or "sq8" (faiss scalar quantisers: 1/2 and 1/4 of the memory; the chosen candidates are
    rescored from the float32 vectors either way, so only recall changes, never a reported score).
    ``fetch``: candidates asked of the index per row (0: ``mem_threshold`` for "flat", twice that for a
    quantised store, whose own scores may misorder near neighbours). ``threads``: faiss threads while
    adding; a graph built with more than one thread depends on timing (not reproducible byte for byte)."""

    m: int = 32
    ef_construction: int = 80
    ef_search: int = 128
    store: str = "fp16"
    fetch: int = 0
    block_sessions: int = 1024
    train_nodes: int = 1 << 16
    threads: int | None = 1


class CausalHNSW:
    """faiss HNSW index of one history's nodes, filled in node order so each row searches earlier nodes.

    Sessions are taken in blocks: a block's rows search the index, which then holds exactly the nodes of
    the sessions before the block; candidates in the block's own earlier sessions come from an exact
    block x block product; both lists are rescored exactly (float64 of the float32 vectors) and the best
    ``mem_threshold`` kept (ties by lower node id). The block's nodes are then added. The index can be
    saved and reloaded, so rows of appended sessions search it without rebuilding (:meth:`save`).
    """

    STORES = ("flat", "fp16", "sq8")

    def __init__(self, d: int, params: HNSWParams | None = None, *, index: Any = None) -> None:
        import faiss  # noqa: PLC0415

        self.params = p = params or HNSWParams()
        if p.store not in self.STORES:
            raise ValueError(f"HNSW store must be one of {self.STORES}, got {p.store!r}")
        if index is None:
            ip = faiss.METRIC_INNER_PRODUCT
            if p.store == "flat":
                index = faiss.IndexHNSWFlat(d, p.m, ip)
            else:
                qt = faiss.ScalarQuantizer.QT_fp16 if p.store == "fp16" else faiss.ScalarQuantizer.QT_8bit
                index = faiss.IndexHNSWSQ(d, qt, p.m, ip)
            index.hnsw.efConstruction = p.ef_construction
        index.hnsw.efSearch = p.ef_search
        self.index = index
        self.d = d

    @property
    def ntotal(self) -> int:
        """Nodes in the index (always whole sessions: the history's first ``ntotal`` nodes)."""
        return int(self.index.ntotal)

    def save(self, path: str | Path) -> None:
        import faiss  # noqa: PLC0415

        faiss.write_index(self.index, str(path))

    @classmethod
    def load(cls, path: str | Path, params: HNSWParams | None = None) -> "CausalHNSW":
        import faiss  # noqa: PLC0415

        index = faiss.read_index(str(path))
        return cls(index.d, params, index=index)

    def _threads(self) -> Any:
        import faiss  # noqa: PLC0415

        n = self.params.threads
        if n is None:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def limit() -> Any:
            old = faiss.omp_get_max_threads()
            faiss.omp_set_num_threads(n)
            try:
                yield
            finally:
                faiss.omp_set_num_threads(old)

        return limit()

    def blocks(self, emb_nodes: Any, rows: np.ndarray, k: int) -> Any:
        """Search the ``rows`` (sorted node ids, all in sessions not yet indexed) block by block and add
        every node of ``emb_nodes`` past :attr:`ntotal`; yields ``(sel, cand, valid)`` per block of rows
        (``sel``: positions in ``rows``; candidates best first by exact score, -1 where invalid)."""
        E = _as_nodes(emb_nodes)
        n = E.shape[0]
        if E.shape[1] != self.d:
            raise ValueError(f"vectors of dimension {E.shape[1]} for an index of dimension {self.d}")
        if rows.size and int(rows[0]) < self.ntotal:
            raise ValueError(f"row {int(rows[0])} is already in the index (it holds {self.ntotal} nodes)")
        p = self.params
        fetch = p.fetch or (k if p.store == "flat" else 2 * k)
        row_sess = rows // N_GRAN
        with self._threads():
            if not self.index.is_trained:
                self.index.train(_read_cols(E, 0, min(n, p.train_nodes)))
            for a in range(self.ntotal // N_GRAN, n // N_GRAN, p.block_sessions):
                b = min(n // N_GRAN, a + p.block_sessions)
                lo_r, hi_r = np.searchsorted(row_sess, [a, b])
                blk = _read_cols(E, a * N_GRAN, b * N_GRAN)
                if hi_r > lo_r:
                    r = rows[lo_r:hi_r]
                    q = _read_rows(E, r)
                    parts = []
                    if self.ntotal:
                        _, i = self.index.search(q, min(fetch, self.ntotal))
                        parts.append(i.astype(np.int64))  # -1 where HNSW found fewer
                    # earlier sessions of this block: exact
                    s_in = q @ blk.T
                    lim = (row_sess[lo_r:hi_r] - a)[:, None] * N_GRAN
                    s_in = np.where(np.arange(blk.shape[0])[None, :] < lim, s_in, -np.inf).astype(np.float32)
                    ii, vv = topk(s_in, min(k, blk.shape[0]))
                    parts.append(np.where(np.isfinite(vv), ii + a * N_GRAN, -1))
                    alli = np.concatenate(parts, 1)
                    ok = alli >= 0
                    sc = np.where(ok, _scores64(E, r, np.where(ok, alli, 0)), -np.inf)
                    o = np.lexsort((np.where(ok, alli, np.iinfo(np.int64).max), -sc), axis=1)[:, :k]
                    ci = np.take_along_axis(alli, o, 1)
                    ok = np.take_along_axis(ok, o, 1)
                    cand = np.full((r.size, k), -1, np.int64)
                    valid = np.zeros((r.size, k), bool)
                    cand[:, : ci.shape[1]] = np.where(ok, ci, -1)
                    valid[:, : ci.shape[1]] = ok
                    yield np.arange(lo_r, hi_r), cand, valid
                self.index.add(blk)

    def candidates(self, emb_nodes: Any, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`blocks`, gathered: (cand [R, k], valid [R, k]) for all ``rows``."""
        cand = np.full((rows.size, k), -1, np.int64)
        valid = np.zeros((rows.size, k), bool)
        for sel, c, v in self.blocks(emb_nodes, rows, k):
            cand[sel], valid[sel] = c, v
        return cand, valid


def associate_hnsw(
    emb_nodes: Any, index: CausalHNSW | None = None, *, n_sessions_done: int = 0, mem_threshold: int = 30,
    min_prior_nodes: int = 20, hnsw: HNSWParams | None = None,
) -> tuple[Edges, CausalHNSW]:
    """Approximate association of the sessions >= ``n_sessions_done``, block by block (bounded memory:
    one block's candidates and GMM at a time; the edges are the only thing that grows).

    ``index``: a :class:`CausalHNSW` holding the first ``n_sessions_done`` sessions (from an earlier call,
    or :meth:`CausalHNSW.load`) so an append searches the new rows only; None builds one (adding, not
    searching, the sessions before ``n_sessions_done``). Returns the edges and the index, which then holds
    every node of ``emb_nodes``. GMM mode only (the MemGAS default).
    """
    E = _as_nodes(emb_nodes)
    k = int(mem_threshold)
    if index is None:
        index = CausalHNSW(E.shape[1], hnsw)
    if index.ntotal != N_GRAN * n_sessions_done and index.ntotal != 0:
        raise ValueError(f"the index holds {index.ntotal} nodes, not the {N_GRAN * n_sessions_done} of "
                         f"{n_sessions_done} sessions done")
    s0 = _first_row_session(n_sessions_done, min_prior_nodes)
    rows = np.arange(s0 * N_GRAN, E.shape[0], dtype=np.int64)
    out = []
    for sel, cand, valid in index.blocks(E, rows, k):
        c = Candidates(rows[sel], *_rescore(E, rows[sel], cand, valid))
        out.append(_edges(c, _accept([c], "gmm", None, "cpu")[0]))
    return concat_edges(out), index


def candidates(
    emb_nodes: Any,
    *,
    n_sessions_done: int = 0,
    mem_threshold: int = 30,
    min_prior_nodes: int = 20,
    device: str = "cpu",
    dense_max_nodes: int = DENSE_MAX_NODES,
    search: str = "auto",
    approx_min_nodes: int | None = None,
    hnsw: HNSWParams | None = None,
) -> Candidates:
    """Candidate rows (top ``mem_threshold`` earlier-session nodes) of the sessions >= ``n_sessions_done``.

    ``search``: "causal" (blocked causal top-k, :func:`_causal_candidates`), "dense" (the full masked
    matrix, the reference), "faiss", "hnsw" (approximate, :class:`CausalHNSW` with ``hnsw``), or "auto":
    on CPU, "hnsw" from ``approx_min_nodes`` nodes (None: never), else faiss above ``dense_max_nodes``
    nodes, else causal; on CUDA always causal (exact: there is no GPU faiss path).
    """
    E = _as_nodes(emb_nodes)
    S = E.shape[0] // N_GRAN
    s0 = _first_row_session(n_sessions_done, min_prior_nodes)
    rows = np.arange(s0 * N_GRAN, S * N_GRAN, dtype=np.int64)
    k = int(mem_threshold)
    if search == "auto":
        on_gpu = get_xp(device)[1] == "cuda"
        if on_gpu:
            search = "causal"
        elif approx_min_nodes is not None and E.shape[0] >= approx_min_nodes:
            search = "hnsw"
        else:
            search = "faiss" if E.shape[0] > dense_max_nodes else "causal"
    if search == "hnsw":
        if n_sessions_done:
            raise ValueError("search='hnsw' with n_sessions_done: use associate_hnsw with the saved index")
        cand, valid = CausalHNSW(E.shape[1], hnsw).candidates(E, rows, k)
    elif search == "causal":
        cand, valid = _causal_candidates(E, rows, k, device)
    elif search == "dense":
        cand, valid = _dense_candidates(E, rows, k, device)
    elif search == "faiss":
        cand, valid = _faiss_candidates(E, rows, k, device)
    else:
        raise ValueError(f"search must be 'causal', 'dense', 'faiss', 'hnsw' or 'auto', got {search!r}")
    cand, valid, sc = _rescore(E, rows, cand, valid)
    return Candidates(rows, cand, valid, sc)


def _accept(all_c: Sequence[Candidates], mode: str, topk_edges: int | None, device: str) -> list[np.ndarray]:
    """Accepted mask per history; all histories' rows go through one batched GMM fit."""
    if mode == "topk":
        if topk_edges is None:
            g = _accept(all_c, "gmm", None, device)
            n_rows = sum(a.shape[0] for a in g)
            topk_edges = max(1, int(round(sum(int(a.sum()) for a in g) / n_rows))) if n_rows else 1
            log.debug("association topk mode: topk_edges = mean GMM-accepted count = %d", topk_edges)
        return [c.valid & (np.arange(c.cand.shape[1])[None, :] < topk_edges) for c in all_c]
    if mode != "gmm":
        raise ValueError(f"mode must be 'gmm' or 'topk', got {mode!r}")
    K = max([c.cand.shape[1] for c in all_c] + [1])
    R = sum(c.rows.size for c in all_c)
    if R == 0:
        return [np.zeros(c.cand.shape, bool) for c in all_c]
    sc = np.zeros((R, K))
    va = np.zeros((R, K), bool)
    a = 0
    for c in all_c:
        r, kk = c.cand.shape
        sc[a : a + r, :kk] = c.scores
        va[a : a + r, :kk] = c.valid
        a += r
    # in row chunks: each row is fitted alone, so chunks change nothing but the memory held (the EM
    # temporaries are ~10 [rows, K] float64 arrays)
    acc = np.concatenate([to_host(fit_gmm_1d(sc[i : i + GMM_ROWS], va[i : i + GMM_ROWS], device=device).accepted)
                          for i in range(0, R, GMM_ROWS)])
    out, a = [], 0
    for c in all_c:
        r, kk = c.cand.shape
        out.append(acc[a : a + r, :kk])
        a += r
    return out


def _edges(c: Candidates, acc: np.ndarray) -> Edges:
    ri, ci = np.nonzero(acc)
    return Edges(c.rows[ri].astype(np.int64), c.cand[ri, ci].astype(np.int64), c.scores[ri, ci].astype(np.float32))


def _small_blas(histories: Sequence[Any], device: str, search: str = "auto",
                dense_max_nodes: int = DENSE_MAX_NODES) -> Any:
    """Single-threaded BLAS for the CPU candidate search, except faiss searches of huge histories.

    Multi-threaded OpenBLAS on small products (a LoCoMo history is ~110 nodes; a causal block is 256 rows
    against its prefix) spends more time waking and syncing threads than computing: measured 20x slower
    on a LoCoMo history and 2.5x slower on a 2,000-node causal search on a busy 2-core machine. The job
    runs one association task per core anyway.
    """
    shapes = [tuple(getattr(h, "shape", None) or np.shape(h)) for h in histories]  # never reads a NodeFile
    n_max = max((int(np.prod(sh[:-1])) for sh in shapes if sh), default=0)
    causal = search == "causal" or (search == "auto" and n_max <= dense_max_nodes)
    small = device == "cpu" and (causal or n_max <= SMALL_HISTORY_NODES)
    if small:
        try:
            from threadpoolctl import threadpool_limits  # noqa: PLC0415  (ships with scikit-learn)

            return threadpool_limits(limits=1, user_api="blas")
        except ImportError:
            pass
    return contextlib.nullcontext()


def associate(
    emb_nodes: Any,
    *,
    n_sessions_done: int = 0,
    mem_threshold: int = 30,
    min_prior_nodes: int = 20,
    mode: str = "gmm",
    topk_edges: int | None = None,
    device: str = "cpu",
    dense_max_nodes: int = DENSE_MAX_NODES,
    search: str = "auto",
    approx_min_nodes: int | None = None,
    hnsw: HNSWParams | None = None,
) -> Edges:
    """Edges contributed by the rows of sessions >= ``n_sessions_done`` of one history.

    ``emb_nodes``: [4*S, d] (or [S, 4, d]) node embeddings in node order. See module docstring.
    """
    return associate_many(
        [emb_nodes], n_sessions_done=[n_sessions_done], mem_threshold=mem_threshold,
        min_prior_nodes=min_prior_nodes, mode=mode, topk_edges=topk_edges, device=device,
        dense_max_nodes=dense_max_nodes, search=search, approx_min_nodes=approx_min_nodes, hnsw=hnsw,
    )[0]


def associate_many(
    histories: Sequence[Any],
    *,
    n_sessions_done: Sequence[int] | None = None,
    mem_threshold: int = 30,
    min_prior_nodes: int = 20,
    mode: str = "gmm",
    topk_edges: int | None = None,
    device: str = "cpu",
    dense_max_nodes: int = DENSE_MAX_NODES,
    search: str = "auto",
    approx_min_nodes: int | None = None,
    hnsw: HNSWParams | None = None,
) -> list[Edges]:
    """Association for many histories: candidate search per history, one batched GMM for all rows.

    Returns one :class:`Edges` per history (node ids local to that history; edges never cross histories).
    """
    done = list(n_sessions_done) if n_sessions_done is not None else [0] * len(histories)
    with _small_blas(histories, device, search, dense_max_nodes):
        cands = [
            candidates(h, n_sessions_done=d, mem_threshold=mem_threshold, min_prior_nodes=min_prior_nodes,
                       device=device, dense_max_nodes=dense_max_nodes, search=search,
                       approx_min_nodes=approx_min_nodes, hnsw=hnsw)
            for h, d in zip(histories, done)
        ]
    accs = _accept(cands, mode, topk_edges, device)
    out = [_edges(c, a) for c, a in zip(cands, accs)]
    log.debug("association: %d histories, %d rows, %d edges", len(out), sum(c.rows.size for c in cands),
              sum(e.src.size for e in out))
    return out


def concat_edges(parts: Sequence[Edges]) -> Edges:
    """Concatenate edge sets of the same history (e.g. incremental builds)."""
    if not parts:
        return Edges.empty()
    return Edges(np.concatenate([p.src for p in parts]), np.concatenate([p.dst for p in parts]),
                 np.concatenate([p.sim for p in parts]))
