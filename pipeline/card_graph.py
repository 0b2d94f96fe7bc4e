"""memgas-cards: JustMem's cards as a fifth MemGAS granularity.

One history's graph holds, per session in position order, its four MemGAS nodes (session, turn, summary,
keyword: ``GRANULARITIES``) and then its cards (``CARD_GRAPH_GRANULARITIES[4]``), so a session's nodes are
contiguous and node ids grow with the session. A session has any number of cards (none too), so node ids are
not ``4*s + g``: :class:`CardGraph` carries each node's granularity and session, and each session's first node.

- Association (:func:`card_graph_candidates`): MemGAS's rule over all nodes, cards included. A node whose
  session has at least ``min_prior_nodes`` nodes before it takes as candidates its ``mem_threshold`` most
  similar nodes of strictly earlier sessions (float32 search, float64 rescoring, ties by lower node id, as
  :mod:`memgas.pipeline.association`); the batched GMM (``edges_from``) keeps the higher-mean component.
- Ranking (:func:`rank_card_graph`): the entropy router over the five granularities (the cards' softmax runs
  over the history's cards; ``entropy="normalised"`` divides each granularity's entropy by log N_g,
  :func:`memgas.kernels.router.entropy_router`), node score = w_g * sim, the ``num_seeds`` best as PPR's reset, PPR over the
  edges, session score = the sum of its nodes' PPR values (its four nodes and its cards), ties by lower
  session index.
- The cards that ranked a session (:func:`session_card_picks`): of each top session, its cards of most PPR mass
  (:func:`card_graph_ppr` gives every node's), what memgas-cards' reader shows beside the session's text.

The association's products have canonical shapes (a tile of node ids against a padded prefix), so a row's
candidates do not depend on which other rows or histories one call computes (a segment of an append gives the
rows of a fresh build); the ranking's products are over one whole history, their shape a function of that
history alone, so a ranking does not depend on which histories share a Ray task, nor on the number of workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from memgas.kernels.backend import get_xp, to_device, to_host
from memgas.kernels.ppr import build_csr, personalized_pagerank
from memgas.kernels.ppr_push import personalized_pagerank_push
from memgas.kernels.router import entropy_router
from memgas.kernels.topk import stable_argsort_desc, topk
from memgas.pipeline.association.nodes import Candidates, _rescore
from memgas.pipeline.config import PPR_EPSILON
from memgas.pipeline.schema import CARD_GRAPH_GRANULARITIES, N_GRAN

#: index of the cards in CARD_GRAPH_GRANULARITIES
CARD = CARD_GRAPH_GRANULARITIES.index("card")
#: rows per similarity block of the dense reference search (a block grid fixed by node ids)
ROW_BLOCK = 256


@dataclass(frozen=True)
class CardGraph:
    """The five-granularity nodes of one history."""

    nodes: np.ndarray  # float32 [N, d] (or NodeBlocks: a long history's, read in blocks)
    gran: np.ndarray  # int64 [N]: index in CARD_GRAPH_GRANULARITIES
    session: np.ndarray  # int64 [N]: position of the node's session
    starts: np.ndarray  # int64 [S]: first node of each session

    @property
    def n_sessions(self) -> int:
        return len(self.starts)

    @property
    def n_cards(self) -> int:
        return int((self.gran == CARD).sum())

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {"nodes": self.nodes, "gran": self.gran, "session": self.session, "starts": self.starts}

    @classmethod
    def from_arrays(cls, a: dict[str, Any]) -> CardGraph:
        """From :meth:`to_arrays` (possibly read-only views out of Ray's object store: copied, aligned)."""
        from memgas.pipeline.association.nodes import ReadInBlocks

        def own(x: Any, dt: Any) -> np.ndarray:
            return np.require(x, dtype=dt, requirements=["C", "A", "W", "O"])
        nodes = a["nodes"] if isinstance(a["nodes"], ReadInBlocks) else own(a["nodes"], np.float32)  # blocks: read as needed
        return cls(nodes, own(a["gran"], np.int64), own(a["session"], np.int64),
                   own(a["starts"], np.int64))


def card_graph_layout(n_sessions: int, card_pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gran [N], session [N], starts [S]) of a graph of ``n_sessions`` sessions whose cards sit at the session
    positions ``card_pos`` (non-decreasing): the node layout without the vectors (a long history's graph is
    built a block at a time by the job's card-graph-associate stage)."""
    S = int(n_sessions)
    card_pos = np.asarray(card_pos, np.int64)
    if len(card_pos) and (np.any(np.diff(card_pos) < 0) or card_pos[0] < 0 or card_pos[-1] >= S):
        raise ValueError(f"card positions must be non-decreasing within 0..{S - 1}")
    counts = np.bincount(card_pos, minlength=S) if S else np.zeros(0, np.int64)
    sizes = N_GRAN + counts
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if S else np.zeros(0, np.int64)
    gran = np.full(int(sizes.sum()), CARD, np.int64)
    gran[(starts[:, None] + np.arange(N_GRAN)[None, :]).reshape(-1)] = np.tile(np.arange(N_GRAN), S)
    return gran, np.repeat(np.arange(S, dtype=np.int64), sizes), starts


def build_card_graph(four: np.ndarray, card_pos: np.ndarray, card_vectors: np.ndarray) -> CardGraph:
    """``four``: MemGAS's node matrix [4*S, d] (node = 4*s + g); ``card_pos`` [C] the session position of each
    card, non-decreasing (cards in session then card order); ``card_vectors`` [C, d]."""
    four = np.asarray(four, np.float32)
    card_pos = np.asarray(card_pos, np.int64)
    S, d = four.shape[0] // N_GRAN, four.shape[1]
    if four.shape[0] != N_GRAN * S or len(card_pos) != len(card_vectors):
        raise ValueError(f"{four.shape[0]} MemGAS nodes (not 4 per session) or {len(card_pos)} card positions "
                         f"for {len(card_vectors)} card vectors")
    gran, session, starts = card_graph_layout(S, card_pos)
    nodes = np.empty((len(gran), d), np.float32)
    is_card = gran == CARD
    nodes[~is_card] = four  # a session's four nodes, then its cards: both in node order
    nodes[is_card] = np.asarray(card_vectors, np.float32).reshape(-1, d)
    return CardGraph(nodes, gran, session, starts)


def _eligible(g: CardGraph, min_prior_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, before): the nodes that take candidates (their session has at least ``min_prior_nodes`` nodes,
    and one, before it) and, per node of the graph, how many nodes precede its session."""
    before = g.starts[g.session] if g.n_sessions else np.zeros(0, np.int64)
    return np.flatnonzero((before >= min_prior_nodes) & (before > 0)).astype(np.int64), before


def card_graph_candidates(g: CardGraph, *, mem_threshold: int, min_prior_nodes: int,
                          device: str = "cpu", sessions: tuple[int, int] | None = None,
                          below: int | None = None) -> Candidates:
    """Each eligible node's ``mem_threshold`` most similar nodes of earlier sessions (module docstring).

    MemGAS's blocked causal search (:func:`memgas.pipeline.association.exact_search._causal_candidates`) with
    each row's prefix given (``g.starts[g.session]``): the lower triangle only, canonical product shapes, so a
    row's candidates do not depend on which other rows are asked. ``sessions=(a, b)``: the rows of sessions
    ``[a, b)`` only (a segment; they read the nodes of sessions ``[0, b)`` only), the same as those rows of
    the whole graph's result. ``below``: the rows below this node id only (the exact prefix of the IVF
    search, :mod:`memgas.pipeline.card_graph_ivf`: the rows after it are not searched exactly)."""
    from memgas.pipeline.association.exact_search import _causal_candidates

    rows, before = _eligible(g, min_prior_nodes)
    if sessions is not None:
        a, b = sessions
        lo, hi = (int(g.starts[s]) if s < g.n_sessions else g.nodes.shape[0] for s in (a, b))
        rows = rows[(rows >= lo) & (rows < hi)]
    if below is not None:
        rows = rows[rows < below]
    cand, valid = _causal_candidates(g.nodes, rows, int(mem_threshold), device, before=before[rows])
    cand, valid, sc = _rescore(g.nodes, rows, cand, valid)
    return Candidates(rows, cand, valid, sc)


def dense_card_graph_candidates(g: CardGraph, *, mem_threshold: int, min_prior_nodes: int,
                                device: str = "cpu") -> Candidates:
    """The reference of :func:`card_graph_candidates`: per block of ``ROW_BLOCK`` node ids, one dense
    [rows, N] product masked to each row's prefix and one full-width top-k (the search before the blocked one;
    tests and ``benchmarks/bench_card_graph_associate.py`` check the two agree)."""
    xp, _ = get_xp(device)
    rows, before = _eligible(g, min_prior_nodes)
    k = int(mem_threshold)
    cand = np.full((rows.size, k), -1, np.int64)
    valid = np.zeros((rows.size, k), bool)
    n = g.nodes.shape[0]
    if rows.size:
        E = xp.asarray(g.nodes)
        block = rows // ROW_BLOCK
        for b in np.unique(block):
            sel = np.flatnonzero(block == b)
            r = rows[sel]
            sims = E[xp.asarray(r)] @ E.T  # float32 [rows, N]
            sims = xp.where(xp.arange(n)[None, :] < xp.asarray(before[r])[:, None], sims, -xp.inf)
            kk = min(k, n)
            idx, val = topk(sims, kk)
            idx, val = to_host(idx), to_host(val)
            ok = np.isfinite(val)
            cand[sel, :kk] = np.where(ok, idx, -1)
            valid[sel, :kk] = ok
    cand, valid, sc = _rescore(g.nodes, rows, cand, valid)
    return Candidates(rows, cand, valid, sc)


def card_graph_edges(g: CardGraph, *, mem_threshold: int, min_prior_nodes: int,
                     device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) of one history's GMM edges (src the later node): the array-level API of the stage."""
    from memgas.pipeline.association.edges import edges_from

    c = card_graph_candidates(g, mem_threshold=mem_threshold, min_prior_nodes=min_prior_nodes, device=device)
    e = edges_from([c], "gmm", None, device)[0]
    return e.src, e.dst


def rank_card_graph(g: CardGraph, queries: np.ndarray, src: np.ndarray, dst: np.ndarray, *, num_seeds: int,
                    damping: float, temp: float, router: str, device: str = "cpu", ppr: str = "exact",
                    ppr_epsilon: float = PPR_EPSILON, entropy: str = "normalised") -> tuple[np.ndarray, np.ndarray]:
    """(order int64 [Q, S], session scores float64 [Q, S]) of one history's queries (module docstring).
    ``entropy``: "normalised" (H_g / log N_g, the default of ``retrieval.card_graph_entropy``) or "raw" (the
    router's H_g, as MemGAS's)."""
    order, scores, _ = card_graph_ppr(g, queries, src, dst, num_seeds=num_seeds, damping=damping, temp=temp,
                                      router=router, device=device, ppr=ppr, ppr_epsilon=ppr_epsilon, entropy=entropy)
    return order, scores


def card_graph_ppr(g: CardGraph, queries: np.ndarray, src: np.ndarray, dst: np.ndarray, *, num_seeds: int,
                   damping: float, temp: float, router: str, device: str = "cpu", ppr: str = "exact",
                   ppr_epsilon: float = PPR_EPSILON,
                   entropy: str = "normalised") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`rank_card_graph`'s (order, session scores) and the PPR mass of every node (float64 [Q, N], on the
    host): what each node added to its session's score (:func:`session_card_picks`)."""
    if entropy not in ("raw", "normalised"):
        raise ValueError(f"entropy must be 'raw' or 'normalised', got {entropy!r}")
    from memgas.pipeline.retrieve import seed_reset

    xp, _ = get_xp(device)
    Q, S, n = len(queries), g.n_sessions, g.nodes.shape[0]
    if S == 0:
        return np.zeros((Q, 0), np.int64), np.zeros((Q, 0), np.float64), np.zeros((Q, n), np.float64)
    E = to_device(g.nodes, xp)
    q = to_device(np.asarray(queries, np.float32), xp)
    sims = q.astype(xp.float64) @ E.astype(xp.float64).T  # [Q, N], float64 as MemGAS's
    by_gran = [xp.asarray(np.flatnonzero(g.gran == i)) for i in range(len(CARD_GRAPH_GRANULARITIES))]
    w, _ = entropy_router([sims[:, ix] for ix in by_gran], temp=temp, rule=router, device=device,
                          normalise=entropy == "normalised")
    reset = seed_reset(sims * w[:, xp.asarray(g.gran)], num_seeds)
    adj = build_csr(to_host(src), to_host(dst), n)
    if ppr == "push":  # CPU only (kernels/ppr_push.py)
        pr = personalized_pagerank_push(adj, to_host(reset), damping, epsilon=ppr_epsilon)
    else:
        pr = personalized_pagerank(adj, reset, damping, device=device)
    mass = np.asarray(to_host(pr), np.float64)
    scores = np.add.reduceat(mass, g.starts, axis=1)  # a session's nodes are contiguous
    return stable_argsort_desc(scores).astype(np.int64), scores, mass


def session_card_picks(g: CardGraph, order: np.ndarray, mass: np.ndarray, top: int,
                       per_session: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The cards that ranked each query's top sessions: per query (rows of ``order`` [Q, S] and ``mass``
    [Q, N], :func:`card_graph_ppr`), ``(session ranks, card nodes)``, int64 each: of each of its ``top`` best
    sessions, the ``per_session`` cards of most PPR mass among those whose mass is positive (a card PPR never
    reached added nothing to its session's score), by session rank (0-based), then mass descending, then node
    id. A session without such a card has none."""
    cards = np.flatnonzero(g.gran == CARD).astype(np.int64)  # in node order
    card_session = g.session[cards]
    out = []
    for qi in range(order.shape[0]):
        best = order[qi, :top]
        rank_of = np.full(g.n_sessions, -1, np.int64)
        rank_of[best] = np.arange(len(best), dtype=np.int64)
        r, m = rank_of[card_session], mass[qi, cards]
        idx = np.flatnonzero((r >= 0) & (m > 0))
        idx = idx[np.lexsort((cards[idx], -m[idx], r[idx]))]
        rr = r[idx]
        within = np.arange(len(idx)) - np.searchsorted(rr, rr, side="left")  # rr is sorted: place in its session
        keep = idx[within < per_session]
        out.append((r[keep], cards[keep]))
    return out
