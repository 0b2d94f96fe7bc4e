"""rank_sessions on a hand-checked 5-session history.

Query = e0, so sim(q, node) = the node's first coordinate. Similarities per granularity (rows = sessions
s0..s4), each column a permutation of {.1, .3, .5, .7, .9} so every granularity has the same entropy and
both router rules give w_g = 1/4:

    session  turn  summary  keyword   sum
s0    .9      .7     .9       .5      3.0
s1    .1      .1     .3       .1      0.6
s2    .5      .9     .1       .9      2.4
s3    .3      .5     .7       .3      1.8
s4    .7      .3     .5       .7      2.2
"""
from __future__ import annotations

import numpy as np
import pytest

from memgas.pipeline.retrieve import rank_sessions, score_with_edges, stack_nodes

TABLE = np.array([[.9, .7, .9, .5], [.1, .1, .3, .1], [.5, .9, .1, .9], [.3, .5, .7, .3], [.7, .3, .5, .7]])


def embeddings() -> tuple[list[np.ndarray], np.ndarray]:
    S, d = 5, 24
    grans = []
    for g in range(4):
        e = np.zeros((S, d), np.float32)
        e[:, 0] = TABLE[:, g]
        e[np.arange(S), 1 + 4 * g + np.arange(S) % 4] = 0.2  # distinct filler, orthogonal to the query
        grans.append(e)
    q = np.zeros((1, d), np.float32)
    q[0, 0] = 1.0
    return grans, q


@pytest.mark.parametrize(
    "method,expected",
    [
        ("session", [0, 4, 2, 3, 1]),
        ("turn", [2, 0, 3, 4, 1]),
        ("summary", [0, 3, 4, 1, 2]),
        ("keyword", [2, 4, 0, 3, 1]),
        # w = 1/4 each: session score = sum / 4 -> 3.0, 2.4, 2.2, 1.8, 0.6
        ("memgas-no-ppr", [0, 2, 4, 3, 1]),
        # 5 sessions < 20 prior nodes: no edges; top 15 of 20 node scores + ties (all .3s kept, .1s
        # dropped): seed sums 3.0, 0.3, 2.3, 1.8, 2.2
        ("memgas", [0, 2, 4, 3, 1]),
        ("memgas-no-gmm", [0, 2, 4, 3, 1]),
        ("memgas-no-router", [0, 2, 4, 3, 1]),
        ("memgas-no-association", [0, 2, 4, 3, 1]),
    ],
)
def test_methods_hand_checked(method: str, expected: list[int]) -> None:
    g, q = embeddings()
    # the graph methods agree here only because 5 sessions (20 nodes) give no node 20 prior nodes: no edges
    from memgas.pipeline.association import associate
    from memgas.pipeline.retrieve import stack_nodes

    assert associate(stack_nodes(*g), mem_threshold=30, min_prior_nodes=20).src.size == 0
    for router in ("paper", "reference"):
        order = rank_sessions(*g, q, method=method, router=router)
        assert order.dtype == np.int64 and order.tolist() == [expected]


def test_seed_ties_kept() -> None:
    g, q = embeddings()
    # num_seeds=5: 5th best = .7, so the four .9s and four .7s are seeds: s0 .9+.7+.9, s2 .9+.9,
    # s3 .7, s4 .7+.7, s1 nothing -> 0, 2, 4, 3, 1
    order, scores = rank_sessions(*g, q, method="memgas-no-router", num_seeds=5, return_scores=True)
    assert order.tolist() == [[0, 2, 4, 3, 1]]
    np.testing.assert_allclose(scores[0] * (2.5 + 1.8 + 0.7 + 1.4), [2.5, 0, 1.8, 0.7, 1.4], atol=1e-6)


def test_ppr_with_hand_edge() -> None:
    g, q = embeddings()
    nodes = stack_nodes(*g)
    # num_seeds=1 keeps the four .9 nodes (ties): node 0 (s0 session), 2 (s0 summary), 9 (s2 turn),
    # 11 (s2 keyword). One edge node 0 -- node 17 (s4 turn), damping 0.5. Solving by hand: isolated
    # seeds get 0.2 each, x0 = 4/15, x17 = 2/15 -> s0 = 7/15, s2 = 6/15, s4 = 2/15, s1 = s3 = 0.
    order, scores = score_with_edges(nodes, q, [17], [0], method="memgas-no-router", num_seeds=1, damping=0.5)
    assert order.tolist() == [[0, 2, 4, 1, 3]]
    np.testing.assert_allclose(scores[0], [7 / 15, 0, 6 / 15, 0, 2 / 15], atol=1e-9)
    # without the edge s4 drops to 0 and ties with s1, s3 (lower index first)
    order, _ = score_with_edges(nodes, q, [17], [0], method="memgas-no-association", num_seeds=1, damping=0.5)
    assert order.tolist() == [[0, 2, 1, 3, 4]]


def test_hybrid_and_errors() -> None:
    g, q = embeddings()
    hyb = np.zeros((5, 24), np.float32)
    hyb[:, 0] = [0.5, 0.5, 0.9, 0.1, 0.5]
    assert rank_sessions(*g, q, method="hybrid", hybrid_emb=hyb).tolist() == [[2, 0, 1, 4, 3]]
    with pytest.raises(ValueError, match="hybrid_emb"):
        rank_sessions(*g, q, method="hybrid")
    with pytest.raises(ValueError, match="unknown retrieval method"):
        rank_sessions(*g, q, method="nope")


def test_batched_queries_equal_single_and_graph_used() -> None:
    f = np.load(__import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures" / "locomo_minilm_nodes.npz")
    nodes = f["nodes"][f["conv_offsets"][0] : f["conv_offsets"][1]].astype(np.float32)
    qs = f["queries"][f["query_conv"] == 0][:20].astype(np.float32)
    g = [nodes[:, i] for i in range(4)]
    for m in ("memgas", "memgas-no-gmm", "memgas-no-ppr"):
        batch = rank_sessions(*g, qs, method=m)
        single = np.concatenate([rank_sessions(*g, qs[i : i + 1], method=m) for i in range(3)])
        np.testing.assert_array_equal(batch[:3], single)
        assert sorted(batch[0].tolist()) == list(range(nodes.shape[0]))
    a = rank_sessions(*g, qs, method="memgas", damping=0.5)
    b = rank_sessions(*g, qs, method="memgas-no-association", damping=0.5)
    assert (a != b).any()  # the association graph changes rankings


def test_graph_methods_differ_once_there_are_edges() -> None:
    """With edges (min_prior_nodes=4), PPR spreads mass along them: memgas differs from the no-association
    ablation, and the top-k edges of the no-GMM ablation differ from the GMM's."""
    from memgas.pipeline.association import associate
    from memgas.pipeline.retrieve import stack_nodes

    rng = np.random.default_rng(3)
    S, d = 12, 16
    g = [rng.normal(size=(S, d)).astype(np.float32) for _ in range(4)]
    q = rng.normal(size=(3, d)).astype(np.float32)
    kw = dict(min_prior_nodes=4, mem_threshold=8, num_seeds=6, damping=0.5)
    gmm = associate(stack_nodes(*g), mem_threshold=8, min_prior_nodes=4, mode="gmm")
    topk = associate(stack_nodes(*g), mem_threshold=8, min_prior_nodes=4, mode="topk", topk_edges=2)
    assert gmm.src.size > 0 and topk.src.size > 0
    assert set(zip(gmm.src.tolist(), gmm.dst.tolist())) != set(zip(topk.src.tolist(), topk.dst.tolist()))
    _, with_edges = rank_sessions(*g, q, method="memgas", return_scores=True, **kw)
    _, without = rank_sessions(*g, q, method="memgas-no-association", return_scores=True, **kw)
    _, no_gmm = rank_sessions(*g, q, method="memgas-no-gmm", return_scores=True, topk_edges=2, **kw)
    assert not np.allclose(with_edges, without) and not np.allclose(with_edges, no_gmm)
