"""Exact candidate search: the top ``mem_threshold`` earlier-session nodes of each row.

:func:`_causal_candidates` (blocked, lower triangle only; NumPy or CuPy), :func:`_dense_candidates` (the
full masked matrix, its reference) and :func:`_faiss_candidates` (progressive faiss ``IndexFlatIP``), plus
the row blocks one Ray task computes (:func:`causal_rows`, :func:`split_rows`).
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from memgas.kernels.backend import get_xp, to_host
from memgas.kernels.topk import topk
from memgas.pipeline.association.nodes import (
    N_GRAN,
    Candidates,
    _as_nodes,
    _first_row_session,
    _read_cols,
    _read_rows,
    _rescore,
    MEM_THRESHOLD,
    MIN_PRIOR_NODES,
)

log = logging.getLogger(__name__)

ROW_CHUNK = 4096  # query rows per dense similarity block (bounds memory to ROW_CHUNK x n_nodes floats)
#: sessions per row block of the causal search (64 sessions = 256 rows: a 256 x prefix float32 block)
CAUSAL_BLOCK_SESSIONS = 64
#: prefix columns per product in the causal search (bounds a block to 256 x 65536 float32 = 64 MB)
COL_CHUNK = 1 << 16
#: column counts of the causal search's products are padded to a multiple of this (canonical shapes)
COL_PAD = 64
#: query tiles held at once by the causal search (each column chunk is read once per group)
GROUP_TILES = 64
#: a tile with fewer than ``1/PACK_BELOW`` of its rows asked is sparse: its rows may share query blocks
PACK_BELOW = 4


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


def _query_blocks(rows: np.ndarray, T: int, pack: bool, before: np.ndarray | None = None) -> list[np.ndarray]:
    """Positions in ``rows`` (sorted node ids) of each query block of :func:`_causal_candidates`
    (``before``: the nodes each row may see, as there).

    A block holds rows with distinct slots ``row % T``; each row sits at its slot of a ``[T, d]`` query
    block, so every row's product is the canonical one whatever block it is in. Blocks are the tiles
    (the rows of one tile of ``T`` rows) and, with ``pack``, *packs* of the sparse tiles' rows.

    Why packs: a tile's product costs ``T x prefix`` however few of its rows are asked, so a sparse row
    set (the IVF stage's candidate-recall sample: ~256 rows spread over thousands of tiles) pays a full
    product per row. Rows of different tiles whose slots differ fit in one block. Greedy in row order,
    a row goes into the first pack whose slot is free, i.e. pack ``j`` of a row is the number of earlier
    sparse rows at its slot. A pack sees the prefix of its last row, so packing is applied only where it
    saves columns: only tiles with fewer than ``T // PACK_BELOW`` asked rows take part (a dense row set,
    a full build, keeps its per-tile blocks and their lower triangle: packing whole tiles would multiply
    early rows against the longest prefix), and only if the packs' summed prefix is below the sparse
    tiles' own. Rows of session 0 see no node and are left out (their lists stay empty either way).
    """
    if rows.size == 0:
        return []
    tile = rows // T
    lim = _before(rows, before)
    cuts = np.flatnonzero(np.diff(tile)) + 1  # rows are sorted (node order): cut where the tile changes
    tiles = np.split(np.arange(rows.size), cuts)
    if not pack:
        return tiles
    sparse = [t for t in tiles if t.size < T // PACK_BELOW]
    if len(sparse) < 2:
        return tiles
    pos = np.concatenate(sparse)
    pos = pos[lim[pos] > 0]
    slot = rows[pos] % T
    o = np.argsort(slot, kind="stable")  # row order within a slot
    first = np.searchsorted(slot[o], slot[o], side="left")
    pack_of = np.empty(pos.size, np.int64)
    pack_of[o] = np.arange(pos.size) - first  # rank among the earlier rows at the same slot
    packs = [pos[pack_of == j] for j in range(int(pack_of.max(initial=-1)) + 1)]
    # a block's products run over its last row's prefix (rows are sorted, so positions are too)
    if sum(int(lim[p[-1]]) for p in packs) >= sum(int(lim[t[-1]]) for t in sparse):
        return tiles
    return [t for t in tiles if t.size >= T // PACK_BELOW] + packs


def _before(rows: np.ndarray, before: np.ndarray | None) -> np.ndarray:
    """Per row, how many nodes it may see (the nodes of earlier sessions: a prefix ``[0, before)``): MemGAS's
    four nodes a session unless given."""
    if before is None:
        return (rows // N_GRAN) * N_GRAN
    before = np.asarray(before, np.int64)
    if before.shape != rows.shape or (before.size and (before.min() < 0 or np.any(before > rows))):
        raise ValueError("before must give each row a prefix [0, before) that ends at or before the row")
    return before


def _causal_candidates(
    E: Any, rows: np.ndarray, k: int, device: str, block_sessions: int = CAUSAL_BLOCK_SESSIONS,
    col_chunk: int = COL_CHUNK, group_tiles: int = GROUP_TILES, pack: bool = True,
    before: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Blocked causal top-k: the same candidates as :func:`_dense_candidates` at about half the work.

    Rows are taken in tiles of ``block_sessions`` sessions on a grid fixed by node ids (tile t = sessions
    [t*block_sessions, (t+1)*block_sessions)). A tile's rows can only see nodes before their own session,
    so each tile multiplies against its *prefix* (the lower triangle of the similarity matrix, never the
    upper one), masks the small in-tile triangle, and takes one top-k per column chunk, merged chunk by
    chunk (earlier chunks first, so equal scores keep the lower node id).

    Every product has a canonical shape: the query block is a whole tile (``4*block_sessions`` rows,
    zero rows where a row is not asked for, each row at its own place ``row % (4*block_sessions)`` in
    the tile) and the column count is padded to a multiple of :data:`COL_PAD`. BLAS gives an entry
    different low bits depending on the product's shape (small products take other kernels), so without
    this a row's float32 scores, and at near-ties its candidates, would depend on which other rows were
    asked for in the same call. With it a row's candidates are the same whatever the row set: one call
    over a history, its row blocks (:func:`causal_rows`, one Ray task each) and the rows of appended
    sessions agree byte for byte.

    Sparse row sets (``pack``, see :func:`_query_blocks`) put rows of different tiles, each still at its
    own place, into one query block: the same shapes, column grid and padding, and each row masked to
    its own prefix. A block runs over the prefix of its longest row, so the width of a row's last column
    chunk follows the other rows of its block: the result relies on a row's scores not depending on the
    product's column count beyond the :data:`COL_PAD` padding, the assumption the tiles made already
    (a tile's prefix is that of its last *asked* row). ``pack=False`` gives the per-tile blocks only.

    ``E`` may be an array, a ``np.memmap``, a :class:`NodeFile` or a
    :class:`~memgas.pipeline.association.blocks.NodeBlocks` (read in blocks: only one column chunk and
    ``group_tiles`` query blocks are in memory at a time). Written against ``xp``: NumPy on CPU, CuPy
    on GPU (the GPU candidate search; there is no GPU faiss path).

    ``before`` (int64, one per row; non-decreasing in the row, at most the row): the nodes a row may see,
    ``[0, before)``. By default a MemGAS history's, four nodes a session (``(row // 4) * 4``); a graph whose
    sessions hold other numbers of nodes (memgas-cards', :mod:`memgas.pipeline.card_graph`) gives its own.
    The tile grid stays ``4*block_sessions`` rows of node ids either way.
    """
    xp, _ = get_xp(device)
    R = rows.size
    cand = np.full((R, k), -1, np.int64)
    valid = np.zeros((R, k), bool)
    if R == 0:
        return cand, valid
    T = block_sessions * N_GRAN  # rows of a full tile
    lim_all = _before(rows, before)  # nodes before each row's session
    blocks = _query_blocks(rows, T, pack, lim_all)
    for g in range(0, len(blocks), group_tiles):
        tiles = []
        for pos in blocks[g : g + group_tiles]:
            lim_h = lim_all[pos]
            ncol = int(lim_h.max())
            if ncol == 0:
                continue
            q = np.zeros((T, E.shape[1]), np.float32)
            slot = rows[pos] % T  # each row at its own place in the tile
            q[slot] = _read_rows(E, rows[pos])
            tiles.append({"pos": pos, "q": xp.asarray(q), "slot": xp.asarray(slot), "ncol": ncol,
                          "lo": int(lim_h.min()), "lim": xp.asarray(lim_h)[:, None], "i": None, "v": None})
        if not tiles:
            continue
        top = max(t["ncol"] for t in tiles)
        # column chunks outside, blocks inside: each chunk of the prefix is read once per group of blocks
        for c0 in range(0, top, col_chunk):
            c1g = min(top, c0 + col_chunk)
            chunk = xp.asarray(_read_cols(E, c0, c0 + _pad(c1g - c0)))
            for t in tiles:
                if t["ncol"] <= c0:
                    continue
                c1 = min(t["ncol"], c0 + col_chunk)
                w = _pad(c1 - c0)
                sims = (t["q"] @ chunk[:w].T)[t["slot"]]  # float32 [block rows, w]: canonical product shape
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
            pos, kk = t["pos"], idx.shape[1]
            ok = np.isfinite(val)
            cand[pos, :kk] = np.where(ok, idx, -1)
            valid[pos, :kk] = ok
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
    emb_nodes: Any, a: int, b: int, *, mem_threshold: int = MEM_THRESHOLD, min_prior_nodes: int = MIN_PRIOR_NODES, device: str = "cpu",
    block_sessions: int = CAUSAL_BLOCK_SESSIONS, col_chunk: int = COL_CHUNK,
) -> Candidates:
    """Exact causal candidates of the rows (node ids) ``[a, b)`` of one history: one Ray task's share.

    ``emb_nodes`` holds at least the nodes ``[0, b)`` (the prefix those rows may see and the rows
    themselves; more is fine and never read): an array, a ``np.memmap``, a :class:`NodeFile` or a
    :class:`~memgas.pipeline.association.blocks.NodeBlocks` (both read in blocks, never whole). Rows before the first eligible session (``min_prior_nodes``) give no candidates. The result
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
