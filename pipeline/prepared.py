"""One history prepared for ranking, once: its node vectors and association graphs; then any batch of queries.

:class:`PreparedGraph` is the one code path of MemGAS ranking (:func:`memgas.pipeline.retrieve.rank_history`,
``score_with_edges``, the rank stage and the job's latency probe all go through it; the methods are described in
:mod:`memgas.pipeline.retrieve`). What it builds once per history, and no longer per question:

- the adjacency (CSR) of each edge mode a method asks for (``gmm``, ``topk``, none for the no-association
  ablation), on the kernel's device, and the push kernel's int64 arrays and degrees (``PushGraph``);
- nothing else from the node vectors: the float32 node matrix is kept as given (an array, or row blocks such
  as :class:`memgas.pipeline.association.blocks.NodeBlocks` that fetch one block at a time).

Float64 similarities without a float64 copy of the node matrix. Each batch's ``sims = q @ E.T`` is computed in
float64 over fixed node-row blocks (:func:`row_spans`: :data:`SIM_BLOCK_ROWS` rows each, the last block taking
the remainder), each block converted to float64 in a reused buffer and multiplied by BLAS. The products of
float32 values are exact in float64, so the bits depend only on the order BLAS sums along d for an element,
and that order is fixed by the kind of call BLAS makes, not by the matrix's length: ``gemv`` when the batch is
one query, otherwise ``gemm``, whose large-matrix kernel sums each element in order along d (for d up to its
K-block), while its small-matrix kernel (OpenBLAS picks it below about 10^6 multiply-adds) sums another way.
A history of fewer than ``2 * SIM_BLOCK_ROWS`` rows is one block, the call of the whole matrix; a longer one
has blocks of at least ``SIM_BLOCK_ROWS`` rows, large enough (>= 6.3 million multiply-adds at d = 384 and two
queries) that each block takes the kernel the whole matrix took. So the bits are those of the whole-matrix
product, checked with the machine's BLAS by ``tests/pipeline/test_prepared.py`` (blocks against the whole
product, one and several queries); had a block kernel summed otherwise, that test would fail. The
single-granularity baselines (float32 ``sgemm``/``sgemv``) are blocked the same way. On a GPU the product is
one block (cuBLAS picks its algorithm per shape, and no device run has checked blocks against the whole
product; the device holds the float64 copy).

One question at a time (a query server, the job's latency probe) is a ``gemv`` over every node row, bound by
memory bandwidth: the rows are read where they lie (:meth:`NodeBlocks.pieces`: an array, Ray's object store, a
spill file's memory map), converted to float64 :data:`GEMV_ROWS` rows at a time, so that BLAS reads them from
the cache, and the blocks may be shared by ``scan_threads`` threads.

Query chunks. A batch's arrays are ``[Q, 4S]`` float64 (below), 6.4 GB each for 200 questions at 10^6 sessions.
:meth:`PreparedGraph.rank_top` (the rank stage's call) ranks the questions :data:`RANK_QUERY_CHUNK` at a time
(fewer on a long history, :data:`RANK_CHUNK_ARRAY_BYTES`),
and keeps each method's top sessions, where that leaves every question's bits as the whole batch gives them:
- every step is row by row: the router's entropies, the seeds, the segment sums, push PPR (each question
  pushed alone) and, since 2026-12-04, the exact PPR (each question converges on its own and every sum over
  nodes is its own column's, ``kernels/ppr.py``; before, its iterations stopped when the whole batch had
  converged, so it kept the whole batch);
- the kernels run on the host (cuBLAS picks its algorithm per shape; no device run has checked chunks);
- the history has at least :data:`SIM_BLOCK_ROWS` node rows, so that a chunk of 2 questions still takes BLAS's
  large-matrix kernel for every block (the argument above), and no chunk is a single question (a lone last
  question joins the chunk before it: one query would be ``gemv``).
Otherwise the batch is one chunk. ``tests/pipeline/test_prepared.py`` checks chunks against the whole batch.

Not per query: a chunk's arrays are ``[Q, 4S]`` float64 (similarities, node scores, reset rows, the exact
PPR's iterates), so a history's ranking needs about ten times ``Q * 4S * 8`` bytes at its peak (exact PPR),
plus one node-row block and its float64 copy (``SIM_BLOCK_ROWS`` to ``2 * SIM_BLOCK_ROWS`` rows), plus the
graph (CSR: 12 bytes per directed edge; push: 16 more).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from memgas.kernels.backend import get_xp, to_device, to_host
from memgas.kernels.ppr import _to_backend_csr, build_csr, personalized_pagerank
from memgas.kernels.ppr_push import PushGraph, personalized_pagerank_push
from memgas.kernels.router import entropy_router
from memgas.kernels.segment import segment_sum_contiguous
from memgas.kernels.topk import kth_largest, stable_argsort_desc, topk
from memgas.pipeline.methods import get_method
from memgas.pipeline.schema import GRANULARITIES, N_GRAN

#: node rows per block of the float64 similarities (8,192 rows: 12 MiB of float32, 24 MiB as float64 at
#: d = 384). A module constant, never a setting: the block must be large enough that BLAS takes the kernel of
#: the whole matrix for it (see the module docstring); a multiple of 4, so a block is whole sessions.
SIM_BLOCK_ROWS = 8192

#: questions ranked together by :meth:`PreparedGraph.rank_top` where a question's bits do not depend on the
#: others of its batch (module docstring, "Query chunks"). A module constant, never a setting: it bounds the
#: ``[Q, 4S]`` arrays and nothing else.
RANK_QUERY_CHUNK = 16
#: at most this many bytes per ``[Q, 4S]`` float64 array of a chunk, so a long history takes fewer questions at a
#: time (8 at 10^6 sessions, where 16 made the exact PPR's rank task 8.5 GB; never fewer than 2, for the reason
#: above). The chunk's size changes no bit (tests/pipeline/test_prepared.py).
RANK_CHUNK_ARRAY_BYTES = 256 << 20

#: node rows per ``gemv`` call when one question's similarities are computed (the latency path): 512 rows are
#: 1.5 MiB as float64, so the converted block is still in the CPU's cache when BLAS reads it. A module
#: constant, never a setting: a multiple of 64, so the rows BLAS's gemv kernels take together (groups of 4 to
#: 64 rows, a remainder at the end) fall as in one call over the whole matrix; the bits are that call's
#: (``tests/pipeline/test_prepared.py``).
GEMV_ROWS = 512


def row_spans(n_rows: int, block_rows: int = SIM_BLOCK_ROWS) -> list[tuple[int, int]]:
    """``[lo, hi)`` blocks of ``n_rows`` node rows: ``block_rows`` each, the last one taking the remainder
    (so every block has at least ``block_rows`` rows, and fewer than ``2 * block_rows`` rows are one block)."""
    n = max(1, n_rows // block_rows)
    cuts = [i * block_rows for i in range(n)] + [n_rows]
    return list(zip(cuts[:-1], cuts[1:]))


def seed_reset(node_scores: Any, num_seeds: int) -> Any:
    """Keep the top ``num_seeds`` scores per row plus ties with the num_seeds-th; zero the rest; clip < 0."""
    xp = get_xp("cuda")[0] if type(node_scores).__module__.startswith("cupy") else np
    n = node_scores.shape[1]
    if num_seeds < n:
        kth = kth_largest(node_scores, num_seeds)
        kept = xp.where(node_scores >= kth, node_scores, 0.0)
        return xp.maximum(kept, 0.0, out=kept)
    return xp.maximum(node_scores, 0.0)


def with_defaults(num_seeds: int | None, damping: float | None, temp: float | None, router: str | None
                  ) -> tuple[int, float, float, str]:
    """The ranking settings, ``None`` replaced by ``RetrievalConfig``'s defaults (the one place they live)."""
    if None not in (num_seeds, damping, temp, router):
        return num_seeds, damping, temp, router  # type: ignore[return-value]
    from memgas.pipeline.config import RetrievalConfig  # noqa: PLC0415  (the config imports the pipeline)

    r = RetrievalConfig()
    return (r.num_seeds if num_seeds is None else num_seeds, r.damping if damping is None else damping,
            r.temp if temp is None else temp, r.router if router is None else router)


def ppr_settings(ppr: str | None, ppr_epsilon: float | None) -> tuple[str, float]:
    """The PPR kernel and push threshold, ``None`` replaced by ``RetrievalConfig``'s defaults."""
    if ppr is None or ppr_epsilon is None:
        from memgas.pipeline.config import RetrievalConfig  # noqa: PLC0415  (as with_defaults)

        r = RetrievalConfig()
        ppr, ppr_epsilon = r.ppr if ppr is None else ppr, r.ppr_epsilon if ppr_epsilon is None else ppr_epsilon
    if ppr not in ("exact", "push"):
        raise ValueError(f"ppr must be 'exact' or 'push', got {ppr!r}")
    return ppr, ppr_epsilon


_NO_EDGES = (np.zeros(0, np.int64), np.zeros(0, np.int64))


class PreparedGraph:
    """One history, ready to rank any batch of queries by any MemGAS method (exact or push PPR).

    ``nodes``: float32 ``[4*S, d]`` in node order (node = 4*s + g), an array or row blocks (anything with
    ``shape`` whose ``[lo:hi]`` gives those rows as float32, e.g. ``NodeBlocks``). ``edges``: ``{"gmm": (src,
    dst), "topk": (src, dst)}`` as the associate stage stored them (a missing mode has no edges). ``hybrid``:
    ``[S, d]`` for the hybrid baseline (array or row blocks). Graphs are built on first use and kept.
    ``scan_threads``: threads that share the similarities' node blocks on the host (the same bits with any
    number; a query server's cores; a Ray task keeps its one CPU).
    """

    def __init__(self, nodes: Any, edges: dict[str, tuple[Any, Any]] | None = None, *, hybrid: Any = None,
                 device: str = "cpu", scan_threads: int = 1) -> None:
        if int(scan_threads) < 1:
            raise ValueError(f"scan_threads must be >= 1, got {scan_threads}")
        self.scan_threads = int(scan_threads)
        shape = tuple(nodes.shape)
        if len(shape) != 2 or shape[0] % N_GRAN:
            raise ValueError(f"node_emb must have 4*S rows, got {shape[0] if shape else shape}")
        self.n_nodes, self.dim = int(shape[0]), int(shape[1])
        self.n_sessions = self.n_nodes // N_GRAN
        self.device = device
        self.xp, _ = get_xp(device)
        if self.xp is np:
            self.nodes = np.asarray(nodes, np.float32) if isinstance(nodes, np.ndarray) else nodes
            self.hybrid = np.asarray(hybrid, np.float32) if isinstance(hybrid, np.ndarray) else hybrid
        else:  # on the device whole (assembled block by block: the host holds one block at a time)
            self.nodes = self._to_device(nodes)
            self.hybrid = None if hybrid is None else self._to_device(hybrid)
        self.edges = {mode: (to_host(s), to_host(d)) for mode, (s, d) in (edges or {}).items()}
        self._csr: dict[str | None, Any] = {}
        self._adj: dict[str | None, Any] = {}
        self._push: dict[str | None, PushGraph] = {}

    def _to_device(self, a: Any) -> Any:
        xp = self.xp
        out = xp.empty(tuple(a.shape), dtype=xp.float32)
        for lo, hi in row_spans(int(a.shape[0])):
            out[lo:hi] = to_device(np.asarray(a[lo:hi], dtype=np.float32), xp)
        return out

    # -- what is built once ---------------------------------------------------------------------------------
    def csr(self, mode: str | None) -> Any:
        """The host CSR of edge mode ``mode`` (``None``: the graph without edges), built on first use."""
        if mode not in self._csr:
            src, dst = self.edges.get(mode, _NO_EDGES) if mode is not None else _NO_EDGES
            self._csr[mode] = build_csr(src, dst, self.n_nodes)
        return self._csr[mode]

    def adjacency(self, mode: str | None) -> Any:
        """The CSR of ``mode`` on the kernel's device (the exact PPR's operand)."""
        if mode not in self._adj:
            self._adj[mode] = _to_backend_csr(self.csr(mode), self.xp)
        return self._adj[mode]

    def push_graph(self, mode: str | None) -> PushGraph:
        """The push kernel's arrays of ``mode`` (host)."""
        if mode not in self._push:
            self._push[mode] = PushGraph(self.csr(mode))
        return self._push[mode]

    def prepare(self, methods: list[str], ppr: str | None = None) -> PreparedGraph:
        """Build now the graphs that ``methods`` rank on under ``ppr`` (else built on first use); returns self."""
        kind, _ = ppr_settings(ppr, 1.0)
        for name in methods:
            m = get_method(name)
            if m.is_graph and m.ppr:
                self.adjacency(m.edges) if kind == "exact" else self.push_graph(m.edges)
        return self

    # -- similarities ----------------------------------------------------------------------------------------
    def _spans(self) -> list[tuple[int, int]]:
        return row_spans(self.n_nodes) if self.xp is np else [(0, self.n_nodes)]

    def _queries(self, queries: Any) -> Any:
        """float32 queries on the kernel's device (any array-like on the host; a device array stays there)."""
        if type(queries).__module__.startswith("cupy"):
            return queries.astype(self.xp.float32, copy=False)
        return to_device(np.asarray(queries, np.float32), self.xp)

    def similarities(self, queries: Any) -> Any:
        """float64 ``[Q, 4S]`` = queries . nodes, over node-row blocks (bits of the whole product: module
        docstring). ``queries`` float32 [Q, d] on the host or the device."""
        xp = self.xp
        q = self._queries(queries)
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise ValueError(f"query_emb must be [Q, {self.dim}], got {tuple(q.shape)}")
        q64 = q.astype(xp.float64)
        spans = self._spans()
        if len(spans) == 1:
            return q64 @ self.nodes[: self.n_nodes].astype(xp.float64).T
        out = xp.empty((q.shape[0], self.n_nodes), xp.float64)
        # one question (gemv): sub-blocks of GEMV_ROWS rows, whose float64 copy stays in the CPU's cache;
        # gemm keeps whole spans (its kernel depends on the size: module docstring)
        step = GEMV_ROWS if q.shape[0] == 1 else None
        width = step or max(hi - lo for lo, hi in spans)

        def scan(mine: list[tuple[int, int]]) -> None:
            buf = xp.empty((width, self.dim), xp.float64)  # reused: no page faults per block
            for lo, hi in mine:
                pieces = self._pieces(lo, hi)
                for a in range(lo, hi, step or hi - lo):
                    b = min(hi, a + (step or hi - lo))
                    blk = buf[: b - a]
                    for pa, pb, rows in pieces:  # float32 -> float64 straight from the source rows
                        if pa < b and pb > a:
                            blk[max(a, pa) - a : min(b, pb) - a] = rows[max(a, pa) - pa : min(b, pb) - pa]
                    out[:, a:b] = q64 @ blk.T

        if self.scan_threads == 1:
            scan(spans)
        else:  # each span's bits are its own (module docstring), so threads change no bit; BLAS and NumPy's
            # casts release the GIL
            from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

            with ThreadPoolExecutor(self.scan_threads) as pool:
                list(pool.map(scan, [spans[i :: self.scan_threads] for i in range(self.scan_threads)]))
        return out

    def _pieces(self, lo: int, hi: int) -> list[tuple[int, int, Any]]:
        """Node rows ``[lo, hi)`` as ``(a, b, rows)`` pieces, views where the source allows (NodeBlocks)."""
        if hasattr(self.nodes, "pieces"):
            return self.nodes.pieces(lo, hi)
        return [(lo, hi, self.nodes[lo:hi])]

    def baseline_scores(self, queries: Any, granularity: str) -> Any:
        """float32 ``[Q, S]`` of a single-granularity baseline (``hybrid``: the hybrid embeddings), over the
        same row blocks."""
        xp = self.xp
        q = self._queries(queries)
        if granularity == "hybrid":
            if self.hybrid is None:
                raise ValueError("method 'hybrid' needs the hybrid embeddings")
            if tuple(self.hybrid.shape) != (self.n_sessions, self.dim):
                raise ValueError(f"hybrid_emb must be [S, d] = {(self.n_sessions, self.dim)}, "
                                 f"got {tuple(self.hybrid.shape)}")
        g = GRANULARITIES.index(granularity) if granularity != "hybrid" else None
        spans = self._spans()
        out = None if len(spans) == 1 else xp.empty((q.shape[0], self.n_sessions), xp.float32)
        for lo, hi in spans:
            s0, s1 = lo // N_GRAN, hi // N_GRAN
            H = self.hybrid[s0:s1] if g is None else self.nodes[lo:hi][g::N_GRAN]
            scores = q @ H.T
            if out is None:
                return scores
            out[:, s0:s1] = scores
        return out

    # -- ranking ----------------------------------------------------------------------------------------------
    def query_chunks(self, n_queries: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` spans of the questions that :meth:`rank_top` ranks together (module docstring, "Query
        chunks"): :data:`RANK_QUERY_CHUNK` each, or fewer where a chunk's ``[Q, 4S]`` arrays would pass
        :data:`RANK_CHUNK_ARRAY_BYTES` (at least 2), the last one taking a lone remainder; one span where a
        question's bits could depend on the batch."""
        size = max(2, min(RANK_QUERY_CHUNK, RANK_CHUNK_ARRAY_BYTES // (8 * max(1, self.n_nodes))))
        if self.xp is not np or self.n_nodes < SIM_BLOCK_ROWS or n_queries <= size:
            return [(0, n_queries)]
        cuts = list(range(0, n_queries, size)) + [n_queries]
        if cuts[-1] - cuts[-2] == 1:
            del cuts[-2]
        return list(zip(cuts[:-1], cuts[1:]))

    def rank_top(self, queries: Any, methods: list[str], top: int, **settings: Any
                 ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Each method's top ``top`` sessions per query: (order int64 [Q, top'], scores float64 [Q, top'], the
        score of each listed session), ``top' = min(top, S)``; the bits of :meth:`rank`'s first ``top`` columns.
        The queries go in :meth:`query_chunks`; ``settings`` are :meth:`rank`'s."""
        q = np.asarray(queries, np.float32) if not type(queries).__module__.startswith("cupy") else queries
        k = min(top, self.n_sessions)
        parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {m: [] for m in methods}
        for lo, hi in self.query_chunks(int(q.shape[0])):
            for m, (order, scores) in self.rank(q[lo:hi], methods, top=k, **settings).items():
                head = order[:, :k]
                parts[m].append((head, np.take_along_axis(scores, head, axis=1)))
        return {m: (np.concatenate([o for o, _ in v]), np.concatenate([s for _, s in v])) if v else
                (np.zeros((0, k), np.int64), np.zeros((0, k), np.float64)) for m, v in parts.items()}

    def rank(
        self,
        queries: Any,
        methods: list[str],
        *,
        num_seeds: int | None = None,
        damping: float | None = None,
        temp: float | None = None,
        router: str | None = None,
        ppr: str | None = None,
        ppr_epsilon: float | None = None,
        top: int | None = None,
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """(order int64 [Q, S], scores float64 [Q, S]) per method, ties by the lower session index. Settings
        left ``None`` take ``RetrievalConfig``'s defaults. ``top``: the order holds only the first ``top``
        sessions (:func:`~memgas.kernels.topk.topk`: the stable sort's first ``top`` columns, ties included,
        without sorting every session)."""
        num_seeds, damping, temp, router = with_defaults(num_seeds, damping, temp, router)
        xp, S = self.xp, self.n_sessions
        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        sims = weights = None  # shared by the graph methods of this batch (the same bits for each)
        for name in methods:
            m = get_method(name)
            if m.family != "memgas":  # scored from cards, not node matrices: justmem.retrieve.rank_history_cards
                raise ValueError(f"rank_history scores the MemGAS methods; {name!r} is a {m.family} method")
            if not m.is_graph:
                scores = self.baseline_scores(queries, m.granularity)
            else:
                ppr_kind, eps = ppr_settings(ppr, ppr_epsilon)
                if sims is None:
                    # float64 similarities: near-equal session scores then order the same as a float64 reference
                    sims = self.similarities(queries)
                if not m.router:
                    w = xp.full((sims.shape[0], N_GRAN), 1.0 / N_GRAN)
                else:
                    if weights is None:
                        weights, _ = entropy_router([sims[:, g::N_GRAN] for g in range(N_GRAN)], temp=temp,
                                                    rule=router, device=self.device)
                    w = weights
                node_scores = sims * xp.tile(w, (1, S))  # w_g * sim, node = 4*s + g
                if not m.ppr:
                    scores = segment_sum_contiguous(node_scores, N_GRAN)
                else:
                    reset = seed_reset(node_scores, num_seeds)
                    del node_scores
                    mode = None if m.edges is None else m.edges  # no association: PPR on an empty graph
                    if ppr_kind == "push":  # CPU only (kernels/ppr_push.py says why); scores go back to the device
                        pr = to_device(personalized_pagerank_push(self.push_graph(mode), to_host(reset), damping,
                                                                  epsilon=eps), xp)
                    else:
                        pr = personalized_pagerank(self.adjacency(mode), reset, damping, device=self.device)
                    del reset
                    scores = segment_sum_contiguous(pr, N_GRAN)
                    del pr
            order = stable_argsort_desc(scores) if top is None or top >= S else topk(scores, top)[0]
            out[name] = (to_host(order).astype(np.int64), to_host(scores).astype(np.float64))
        return out
