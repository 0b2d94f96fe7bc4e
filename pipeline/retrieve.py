"""Session ranking: single-granularity baselines, hybrid, MemGAS and its ablations (all queries batched).

MemGAS (``method="memgas"``), per query q of one history with S sessions (4*S nodes, node = 4*s + g):

1. sims = q . node embeddings (dot product); router weights w [Q, 4] from the per-granularity entropies
   (``memgas.kernels.router``; ``router="paper"`` or ``"reference"``).
2. node score = w_g * sim; keep the ``num_seeds`` best node scores *and every score equal to the
   num_seeds-th* (the authors' threshold test ``score >= kth``), zero the rest, clip negatives to 0.
3. Personalized PageRank (``damping`` = follow-edge probability) on the association graph with that
   reset vector: ``ppr="exact"`` (``memgas.kernels.ppr``, all queries at once) or ``ppr="push"`` (local
   forward push, ``memgas.kernels.ppr_push``, residual < ``ppr_epsilon`` * degree, CPU).
4. session score = sum of its 4 nodes' PPR values; order = descending, ties by lower session index.

Ablations: ``memgas-no-gmm`` (association keeps top-k edges, see ``association.associate``),
``memgas-no-ppr`` (session score = sum over its 4 nodes of w_g * sim, no seeds, no graph),
``memgas-no-router`` (w_g = 1/4), ``memgas-no-association`` (PPR on a graph without edges, which returns
the normalised reset: session score = its share of the clipped seed scores).

A query whose reset vector is all zero (every top node score <= 0) gets PPR scores 0 for every session,
so its order is the session order (documented tie rule).
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from memgas.kernels.backend import one_blas_thread
from memgas.pipeline.association import N_GRAN, associate
from memgas.pipeline.methods import get_method
from memgas.pipeline.prepared import PreparedGraph, ppr_settings, seed_reset  # noqa: F401  (seed_reset: API)

log = logging.getLogger(__name__)


def stack_nodes(session_emb: Any, turn_emb: Any, summary_emb: Any, keyword_emb: Any) -> np.ndarray:
    """[S, d] x 4 -> node matrix [4*S, d] float32 in node order (node = 4*s + g)."""
    parts = [np.asarray(a, dtype=np.float32) for a in (session_emb, turn_emb, summary_emb, keyword_emb)]
    shapes = {p.shape for p in parts}
    if len(shapes) != 1 or parts[0].ndim != 2:
        raise ValueError(f"the four granularity embeddings must share one [S, d] shape, got {shapes}")
    return np.ascontiguousarray(np.stack(parts, axis=1).reshape(-1, parts[0].shape[1]))


def score_with_edges(
    node_emb: Any,
    query_emb: Any,
    src: Any,
    dst: Any,
    *,
    method: str = "memgas",
    num_seeds: int | None = None,
    damping: float | None = None,
    temp: float | None = None,
    router: str | None = None,
    device: str = "cpu",
    ppr: str | None = None,
    ppr_epsilon: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Rank sessions of one history given a precomputed association edge list.

    ``node_emb`` [4*S, d] (node order), ``query_emb`` [Q, d], ``src``/``dst`` undirected edges (node ids).
    Methods: memgas, memgas-no-gmm (pass the top-k edges), memgas-no-ppr, memgas-no-router,
    memgas-no-association (edges ignored). Returns (order int64 [Q, S], session scores float64 [Q, S]).
    Settings left ``None`` take ``RetrievalConfig``'s defaults. One call prepares the graph and ranks once:
    to rank many batches against one history, build a :class:`~memgas.pipeline.prepared.PreparedGraph`.
    """
    m = get_method(method)
    if not m.is_graph:
        raise ValueError(f"score_with_edges handles the MemGAS methods, not {method!r}")
    ppr_settings(ppr, ppr_epsilon)  # a bad setting fails before any work
    edges = {} if m.edges is None else {m.edges: (src, dst)}
    g = PreparedGraph(node_emb, edges, device=device)
    return g.rank(query_emb, [method], num_seeds=num_seeds, damping=damping, temp=temp, router=router, ppr=ppr,
                  ppr_epsilon=ppr_epsilon)[method]


def rank_sessions(
    session_emb: Any,
    turn_emb: Any,
    summary_emb: Any,
    keyword_emb: Any,
    query_emb: Any,
    method: str = "memgas",
    mem_threshold: int | None = None,
    min_prior_nodes: int | None = None,
    num_seeds: int | None = None,
    damping: float | None = None,
    temp: float | None = None,
    router: str | None = None,
    device: str = "cpu",
    *,
    hybrid_emb: Any | None = None,
    topk_edges: int | None = None,
    return_scores: bool = False,
    ppr: str | None = None,
    ppr_epsilon: float | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Session indices per query, best first (int64 [Q, S]); ties broken by the lower session index.

    The array-level API over one history: it associates the nodes as the associate stage does and ranks
    with :func:`rank_history`, the rank stage's own function, so it gives the job's ranking for the same
    vectors and settings. Settings left ``None`` take the job's defaults (``AssociationConfig`` and
    ``RetrievalConfig`` in ``pipeline/config.py``, the one place they live). See the module docstring for
    the methods. ``hybrid`` needs ``hybrid_emb`` [S, d] (one embedding of "summary keywords session" per
    session). ``return_scores=True`` also returns the scores [Q, S].
    """
    from memgas.pipeline.config import AssociationConfig, RetrievalConfig

    a, r = AssociationConfig(), RetrievalConfig()
    m = get_method(method)
    if m.family != "memgas":
        raise ValueError(f"rank_sessions scores the MemGAS methods; {method!r} needs cards "
                         "(memgas.pipeline.justmem.retrieve.rank_cards)")
    router = r.router if router is None else router
    if router not in ("paper", "reference"):
        raise ValueError(f"router must be 'paper' or 'reference', got {router!r}")
    nodes = stack_nodes(session_emb, turn_emb, summary_emb, keyword_emb)
    q = np.asarray(query_emb, dtype=np.float32)
    if q.ndim != 2 or q.shape[1] != nodes.shape[1]:
        raise ValueError(f"query_emb must be [Q, {nodes.shape[1]}], got {q.shape}")
    H = None
    if m.granularity == "hybrid":
        if hybrid_emb is None:
            raise ValueError("method='hybrid' needs hybrid_emb=[S, d] (embeddings of 'summary keywords session')")
        H = np.asarray(hybrid_emb, dtype=np.float32)
        if H.shape != (nodes.shape[0] // N_GRAN, nodes.shape[1]):
            raise ValueError(f"hybrid_emb must be [S, d] = {(nodes.shape[0] // N_GRAN, nodes.shape[1])}, got {H.shape}")
    edges: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    with one_blas_thread():  # the job's kernels run with one BLAS thread: the same bits here
        if m.is_graph and m.edges is not None:
            e = associate(nodes, mem_threshold=a.mem_threshold if mem_threshold is None else mem_threshold,
                          min_prior_nodes=a.min_prior_nodes if min_prior_nodes is None else min_prior_nodes,
                          mode=m.edges, topk_edges=a.topk_edges if topk_edges is None else topk_edges,
                          search="causal", device=device)
            edges[m.edges] = (e.src, e.dst)
        order, scores = rank_history(nodes, q, edges, [method], hybrid=H,
                                     num_seeds=r.num_seeds if num_seeds is None else num_seeds,
                                     damping=r.damping if damping is None else damping,
                                     temp=r.temp if temp is None else temp, router=router, device=device,
                                     ppr=ppr, ppr_epsilon=ppr_epsilon)[method]
    return (order, scores) if return_scores else order


def rank_history(
    nodes: np.ndarray,
    queries: np.ndarray,
    edges: dict[str, tuple[np.ndarray, np.ndarray]],
    methods: list[str],
    *,
    hybrid: np.ndarray | None = None,
    num_seeds: int | None = None,
    damping: float | None = None,
    temp: float | None = None,
    router: str | None = None,
    device: str = "cpu",
    ppr: str | None = None,
    ppr_epsilon: float | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(order [Q, S], scores [Q, S]) per method for the queries of one history, from stored edges.

    ``nodes`` [4*S, d] in node order; ``edges`` = {"gmm": (src, dst), "topk": (src, dst)} as the
    association stage stored them; ``hybrid`` [S, d] for the hybrid baseline. ``ppr``: "exact" or "push"
    (``ppr_epsilon`` its threshold). Settings left ``None`` take ``RetrievalConfig``'s defaults.
    """
    for name in methods:  # before any work: a method of another family is an error
        m = get_method(name)
        if m.family != "memgas":  # scored from cards, not node matrices: justmem.retrieve.rank_history_cards
            raise ValueError(f"rank_history scores the MemGAS methods; {name!r} is a {m.family} method")
    g = PreparedGraph(nodes, edges, hybrid=hybrid, device=device)
    return g.rank(queries, methods, num_seeds=num_seeds, damping=damping, temp=temp, router=router, ppr=ppr,
                  ppr_epsilon=ppr_epsilon)
