"""Association entry points: candidate search per history (exact or approximate), then one batched accept."""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Sequence

import numpy as np

from memgas.kernels.backend import get_xp
from memgas.pipeline.association.edges import Edges, _accept, _edges
from memgas.pipeline.association.exact_search import (
    CAUSAL_BLOCK_SESSIONS,
    COL_CHUNK,
    _causal_candidates,
    _dense_candidates,
    _faiss_candidates,
    causal_rows,
)
from memgas.pipeline.association.hnsw_search import CausalHNSW, HNSWParams
from memgas.pipeline.association.ivf_search import CausalIVF, IVFParams
from memgas.pipeline.association.nodes import MEM_THRESHOLD, MIN_PRIOR_NODES, N_GRAN, Candidates, _as_nodes, _first_row_session, _rescore

log = logging.getLogger(__name__)

SMALL_HISTORY_NODES = 1024  # at or below this many nodes per history, CPU search uses 1 BLAS thread


def candidates(
    emb_nodes: Any,
    *,
    n_sessions_done: int = 0,
    mem_threshold: int = MEM_THRESHOLD,
    min_prior_nodes: int = MIN_PRIOR_NODES,
    device: str = "cpu",
    search: str = "auto",
    approx_min_nodes: int | None = None,
    hnsw: HNSWParams | None = None,
    ivf: IVFParams | None = None,
) -> Candidates:
    """Candidate rows (top ``mem_threshold`` earlier-session nodes) of the sessions >= ``n_sessions_done``.

    ``search``: "causal" (blocked causal top-k, :func:`_causal_candidates`), "dense" (the full masked
    matrix, the reference), "faiss", "hnsw" (approximate, :class:`CausalHNSW` with ``hnsw``), "ivf"
    (approximate, :class:`CausalIVF` with ``ivf``; never picked by "auto"), or "auto":
    on CPU, "hnsw" from ``approx_min_nodes`` nodes (None: never), else causal; on CUDA always causal.
    The causal search is exact with memory bounded by column blocks whatever the history's length, so
    "auto" no longer switches to faiss for long histories (the job's search, pipeline/config.py).
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
            search = "causal"
    if search == "hnsw":
        if n_sessions_done:
            raise ValueError("search='hnsw' with n_sessions_done: use associate_hnsw with the saved index")
        cand, valid = CausalHNSW(E.shape[1], hnsw).candidates(E, rows, k)
    elif search == "ivf":
        if n_sessions_done:
            raise ValueError("search='ivf' with n_sessions_done: use associate_ivf with the saved index")
        cand, valid = CausalIVF(E.shape[1], ivf).candidates(E, rows, k)
    elif search == "causal":
        cand, valid = _causal_candidates(E, rows, k, device)
    elif search == "dense":
        cand, valid = _dense_candidates(E, rows, k, device)
    elif search == "faiss":
        cand, valid = _faiss_candidates(E, rows, k, device)
    else:
        raise ValueError(f"search must be 'causal', 'dense', 'faiss', 'hnsw', 'ivf' or 'auto', got {search!r}")
    cand, valid, sc = _rescore(E, rows, cand, valid)
    return Candidates(rows, cand, valid, sc)


def associate_rows(
    emb_nodes: Any, a: int, b: int, *, mem_threshold: int = MEM_THRESHOLD, min_prior_nodes: int = MIN_PRIOR_NODES, mode: str = "gmm",
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


def _small_blas(histories: Sequence[Any], device: str, search: str, approx_min_nodes: int | None) -> Any:
    """Single-threaded BLAS for the CPU candidate search, except faiss searches of huge histories.

    Multi-threaded OpenBLAS on small products (a LoCoMo history is ~110 nodes; a causal block is 256 rows
    against its prefix) spends more time waking and syncing threads than computing, most of all on a busy
    machine. The job runs one association task per core anyway.
    """
    shapes = [tuple(getattr(h, "shape", None) or np.shape(h)) for h in histories]  # never reads a NodeFile
    n_max = max((int(np.prod(sh[:-1])) for sh in shapes if sh), default=0)
    causal = search == "causal" or (search == "auto" and (approx_min_nodes is None or n_max < approx_min_nodes))
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
    mem_threshold: int = MEM_THRESHOLD,
    min_prior_nodes: int = MIN_PRIOR_NODES,
    mode: str = "gmm",
    topk_edges: int | None = None,
    device: str = "cpu",
    search: str = "auto",
    approx_min_nodes: int | None = None,
    hnsw: HNSWParams | None = None,
    ivf: IVFParams | None = None,
) -> Edges:
    """Edges contributed by the rows of sessions >= ``n_sessions_done`` of one history.

    ``emb_nodes``: [4*S, d] (or [S, 4, d]) node embeddings in node order. See module docstring.
    """
    return associate_many(
        [emb_nodes], n_sessions_done=[n_sessions_done], mem_threshold=mem_threshold,
        min_prior_nodes=min_prior_nodes, mode=mode, topk_edges=topk_edges, device=device,
        search=search, approx_min_nodes=approx_min_nodes, hnsw=hnsw, ivf=ivf,
    )[0]


def associate_many(
    histories: Sequence[Any],
    *,
    n_sessions_done: Sequence[int] | None = None,
    mem_threshold: int = MEM_THRESHOLD,
    min_prior_nodes: int = MIN_PRIOR_NODES,
    mode: str = "gmm",
    topk_edges: int | None = None,
    device: str = "cpu",
    search: str = "auto",
    approx_min_nodes: int | None = None,
    hnsw: HNSWParams | None = None,
    ivf: IVFParams | None = None,
) -> list[Edges]:
    """Association for many histories: candidate search per history, one batched GMM for all rows.

    Returns one :class:`Edges` per history (node ids local to that history; edges never cross histories).
    """
    done = list(n_sessions_done) if n_sessions_done is not None else [0] * len(histories)
    with _small_blas(histories, device, search, approx_min_nodes):
        cands = [
            candidates(h, n_sessions_done=d, mem_threshold=mem_threshold, min_prior_nodes=min_prior_nodes,
                       device=device, search=search,
                       approx_min_nodes=approx_min_nodes, hnsw=hnsw, ivf=ivf)
            for h, d in zip(histories, done)
        ]
    accs = _accept(cands, mode, topk_edges, device)
    out = [_edges(c, a) for c, a in zip(cands, accs)]
    log.debug("association: %d histories, %d rows, %d edges", len(out), sum(c.rows.size for c in cands),
              sum(e.src.size for e in out))
    return out
