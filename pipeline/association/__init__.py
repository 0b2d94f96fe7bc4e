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
  same rows, rounded (e.g. 12.7 -> 13), so the ablation changes *which* edges, not how many.
- incremental: ``associate(emb, n_sessions_done=k)`` computes only rows of sessions >= k (cost
  O(new x history)); concatenating its outputs equals one build over all sessions.

Modules: ``nodes`` (node matrices, files, prefixes, exact rescoring), ``exact_search`` (causal, dense and
faiss-flat candidate search; row blocks of one task), ``hnsw_search`` (approximate faiss HNSW search),
``ivf_search`` (approximate faiss IVF search, centroids trained once on a prefix),
``edges`` (GMM accept -> edges), ``build`` (the ``associate*`` entry points and the search dispatch).
"""

# the private names are for tests (the searches' agreement) and benchmarks/, which reach them here
from memgas.pipeline.association.build import SMALL_HISTORY_NODES, associate, associate_many, associate_rows, candidates
from memgas.pipeline.association.build import _small_blas as _small_blas
from memgas.pipeline.association.edges import GMM_ROWS, Edges, concat_edges
from memgas.pipeline.association.edges import _accept as _accept
from memgas.pipeline.association.edges import _edges as _edges
from memgas.pipeline.association.exact_search import (
    CAUSAL_BLOCK_SESSIONS,
    COL_CHUNK,
    COL_PAD,
    GROUP_TILES,
    ROW_CHUNK,
    causal_rows,
    split_rows,
)
from memgas.pipeline.association.exact_search import _causal_candidates as _causal_candidates
from memgas.pipeline.association.exact_search import _dense_candidates as _dense_candidates
from memgas.pipeline.association.exact_search import _faiss_candidates as _faiss_candidates
from memgas.pipeline.association.exact_search import _topk_rows as _topk_rows
from memgas.pipeline.association.hnsw_search import CausalHNSW, HNSWParams, associate_hnsw
from memgas.pipeline.association.ivf_search import CausalIVF, IVFParams, associate_ivf
from memgas.pipeline.association.nodes import N_GRAN, Candidates, NodeFile
from memgas.pipeline.association.nodes import _as_nodes as _as_nodes
from memgas.pipeline.association.nodes import _first_row_session as _first_row_session
from memgas.pipeline.association.nodes import _rescore as _rescore

__all__ = [
    "CAUSAL_BLOCK_SESSIONS", "COL_CHUNK", "COL_PAD", "GMM_ROWS", "GROUP_TILES", "N_GRAN",
    "ROW_CHUNK", "SMALL_HISTORY_NODES", "Candidates", "CausalHNSW", "CausalIVF", "Edges", "HNSWParams",
    "IVFParams", "NodeFile", "associate", "associate_hnsw", "associate_ivf", "associate_many", "associate_rows", "candidates", "causal_rows",
    "concat_edges", "split_rows",
]
