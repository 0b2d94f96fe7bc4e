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
from dataclasses import dataclass
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


def _as_nodes(emb_nodes: Any) -> np.ndarray:
    e = np.asarray(emb_nodes)
    if e.ndim == 3:
        if e.shape[1] != N_GRAN:
            raise ValueError(f"emb_nodes [S, 4, d] expected, got {e.shape}")
        e = e.reshape(-1, e.shape[-1])
    if e.ndim != 2 or e.shape[0] % N_GRAN:
        raise ValueError(f"emb_nodes must be [4*S, d] (or [S, 4, d]), got shape {e.shape}")
    return np.ascontiguousarray(e, dtype=np.float32)


def _first_row_session(n_sessions_done: int, min_prior_nodes: int) -> int:
    # session s is eligible when it has 4*s >= min_prior_nodes nodes before it
    return max(n_sessions_done, -(-min_prior_nodes // N_GRAN))


def _rescore(E: np.ndarray, rows: np.ndarray, cand: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, ...]:
    """float64 scores of the chosen candidates, then order best first (ties: lower node id)."""
    c = np.where(valid, cand, 0)
    E64 = E.astype(np.float64)
    sc = np.empty(c.shape)
    # chunked so the gathered [chunk, K, d] block stays in cache (a single gather of all rows is ~100s MB)
    for a in range(0, rows.size, 256):
        sc[a : a + 256] = np.einsum("rd,rkd->rk", E64[rows[a : a + 256]], E64[c[a : a + 256]])
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


def _causal_candidates(
    E: np.ndarray, rows: np.ndarray, k: int, device: str, block_sessions: int = CAUSAL_BLOCK_SESSIONS,
    col_chunk: int = COL_CHUNK,
) -> tuple[np.ndarray, np.ndarray]:
    """Blocked causal top-k: the same candidates as :func:`_dense_candidates` at about half the work.

    Rows are taken in blocks of ``block_sessions`` sessions. A block's rows can only see nodes before their
    own session, so each block multiplies against its *prefix* ``E[:last visible node]`` (the lower
    triangle of the similarity matrix, never the upper one), masks only the small in-block triangle (the
    columns of the block's own earlier sessions), and takes one top-k over the prefix. Every product and
    every top-k pass is over ~N^2/2 entries instead of N^2, in cache-sized blocks. Written against ``xp``:
    NumPy on CPU, CuPy on GPU (the GPU candidate search; there is no GPU faiss path).
    """
    xp, _ = get_xp(device)
    R = rows.size
    cand = np.full((R, k), -1, np.int64)
    valid = np.zeros((R, k), bool)
    if R == 0:
        return cand, valid
    Ed = xp.asarray(E)
    row_sess = rows // N_GRAN
    # rows are sorted (node order): cut them where the session block changes
    blk = row_sess // block_sessions
    cuts = np.flatnonzero(np.diff(blk)) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [R]])
    for a, b in zip(starts.tolist(), ends.tolist()):
        r = rows[a:b]
        lim_h = row_sess[a:b] * N_GRAN  # nodes before each row's session
        ncol = int(lim_h.max())
        if ncol == 0:
            continue
        lo = int(lim_h.min())  # columns < lo are visible to every row of the block
        q = Ed[xp.asarray(r)]
        lim = xp.asarray(lim_h)[:, None]
        best_i = best_v = None
        # column chunks bound memory on huge histories (a 10^6-session history on a GPU); one chunk usually
        for c0 in range(0, ncol, col_chunk):
            c1 = min(ncol, c0 + col_chunk)
            sims = q @ Ed[c0:c1].T  # float32 [block rows, chunk of the prefix]
            if c1 > lo:  # the in-block triangle: columns of the block's own earlier sessions
                m0 = max(lo, c0)
                tail = xp.arange(m0, c1)[None, :] < lim
                sims[:, m0 - c0 :] = xp.where(tail, sims[:, m0 - c0 :], -xp.inf)
            i, v = _topk_rows(sims, k)
            i = i + c0
            if best_i is not None:
                # earlier chunks first: equal scores keep the lower node id (topk prefers lower positions)
                i2, v2 = xp.concatenate([best_i, i], 1), xp.concatenate([best_v, v], 1)
                j, v = _topk_rows(v2, k)
                i = xp.take_along_axis(i2, j, 1)
            best_i, best_v = i, v
        idx, val = to_host(best_i), to_host(best_v)
        kk = idx.shape[1]
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


def candidates(
    emb_nodes: Any,
    *,
    n_sessions_done: int = 0,
    mem_threshold: int = 30,
    min_prior_nodes: int = 20,
    device: str = "cpu",
    dense_max_nodes: int = DENSE_MAX_NODES,
    search: str = "auto",
) -> Candidates:
    """Candidate rows (top ``mem_threshold`` earlier-session nodes) of the sessions >= ``n_sessions_done``.

    ``search``: "causal" (blocked causal top-k, :func:`_causal_candidates`), "dense" (the full masked
    matrix, the reference), "faiss", or "auto" (faiss above ``dense_max_nodes`` nodes on CPU, else causal;
    on CUDA always causal: there is no GPU faiss path).
    """
    E = _as_nodes(emb_nodes)
    S = E.shape[0] // N_GRAN
    s0 = _first_row_session(n_sessions_done, min_prior_nodes)
    rows = np.arange(s0 * N_GRAN, S * N_GRAN, dtype=np.int64)
    k = int(mem_threshold)
    if search == "auto":
        on_gpu = get_xp(device)[1] == "cuda"
        search = "faiss" if E.shape[0] > dense_max_nodes and not on_gpu else "causal"
    if search == "causal":
        cand, valid = _causal_candidates(E, rows, k, device)
    elif search == "dense":
        cand, valid = _dense_candidates(E, rows, k, device)
    elif search == "faiss":
        cand, valid = _faiss_candidates(E, rows, k, device)
    else:
        raise ValueError(f"search must be 'causal', 'dense', 'faiss' or 'auto', got {search!r}")
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
    acc = to_host(fit_gmm_1d(sc, va, device=device).accepted)
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
    n_max = max((np.asarray(h).size // max(np.asarray(h).shape[-1], 1) for h in histories), default=0)
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
) -> Edges:
    """Edges contributed by the rows of sessions >= ``n_sessions_done`` of one history.

    ``emb_nodes``: [4*S, d] (or [S, 4, d]) node embeddings in node order. See module docstring.
    """
    return associate_many(
        [emb_nodes], n_sessions_done=[n_sessions_done], mem_threshold=mem_threshold,
        min_prior_nodes=min_prior_nodes, mode=mode, topk_edges=topk_edges, device=device,
        dense_max_nodes=dense_max_nodes, search=search,
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
) -> list[Edges]:
    """Association for many histories: candidate search per history, one batched GMM for all rows.

    Returns one :class:`Edges` per history (node ids local to that history; edges never cross histories).
    """
    done = list(n_sessions_done) if n_sessions_done is not None else [0] * len(histories)
    with _small_blas(histories, device, search, dense_max_nodes):
        cands = [
            candidates(h, n_sessions_done=d, mem_threshold=mem_threshold, min_prior_nodes=min_prior_nodes,
                       device=device, dense_max_nodes=dense_max_nodes, search=search)
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
