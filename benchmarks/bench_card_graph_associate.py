"""memgas-cards' candidate search: the dense reference (one [rows, N] product and one full-width top-k per
256-row block) against the blocked causal search the card-graph-associate stage runs (lower triangle only,
canonical shapes), in the same run, on the same card graphs, with their results compared.

Graphs of ``--histories`` histories at LongMemEval-M's shape by default: ``--sessions`` sessions of four MemGAS
nodes (seeded clustered vectors, ``pipeline/synth_vectors.py``) and about ``--cards`` cards each (each a
noisy copy of one of its session's nodes), ``--dim`` dimensions. Both searches run with one BLAS thread (as
the job's tasks do); each history's candidates, validity and float64 scores are compared with
``np.array_equal``, and the GMM edges of both with each other. Times are CPU seconds per history.

    .venv/bin/python benchmarks/bench_card_graph_associate.py --histories 4
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from memgas.kernels.backend import one_blas_thread
from memgas.pipeline.association.edges import edges_from
from memgas.pipeline.association.nodes import MEM_THRESHOLD, MIN_PRIOR_NODES, N_GRAN
from memgas.pipeline.card_graph import CardGraph, build_card_graph, card_graph_candidates, dense_card_graph_candidates
from memgas.pipeline.synth_vectors import clustered_nodes


def graph(sessions: int, cards: float, dim: int, seed: int) -> CardGraph:
    """One history: clustered MemGAS nodes and, per session, a Poisson(``cards``) number of cards near them."""
    rng = np.random.default_rng(seed)
    four = clustered_nodes(0, sessions, dim=dim, seed=seed)
    counts = rng.poisson(cards, sessions)
    pos = np.repeat(np.arange(sessions), counts)
    near = four[N_GRAN * pos + rng.integers(0, N_GRAN, pos.size)]
    c = near + 0.5 * rng.standard_normal(near.shape).astype(np.float32) / np.sqrt(dim)
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    return build_card_graph(four, pos, c.astype(np.float32))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--histories", type=int, default=4)
    ap.add_argument("--sessions", type=int, default=500)
    ap.add_argument("--cards", type=float, default=16.0, help="mean cards per session")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--k", type=int, default=MEM_THRESHOLD)
    ap.add_argument("--min-prior-nodes", type=int, default=MIN_PRIOR_NODES)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    graphs = [graph(args.sessions, args.cards, args.dim, args.seed + i) for i in range(args.histories)]
    kw = dict(mem_threshold=args.k, min_prior_nodes=args.min_prior_nodes)
    res = {}
    with one_blas_thread():
        for name, search in (("dense", dense_card_graph_candidates), ("blocked", card_graph_candidates)):
            t0 = time.process_time()  # CPU seconds: one BLAS thread, so the load of other processes counts less
            res[name] = ([search(g, **kw) for g in graphs], time.process_time() - t0)
    (old, t_old), (new, t_new) = res["dense"], res["blocked"]
    same = all(np.array_equal(getattr(a, f), getattr(b, f)) for a, b in zip(old, new)
               for f in ("rows", "cand", "valid", "scores"))
    eo, en = edges_from(old, "gmm", None, "cpu"), edges_from(new, "gmm", None, "cpu")
    same_edges = all(np.array_equal(x.src, y.src) and np.array_equal(x.dst, y.dst) and np.array_equal(x.sim, y.sim)
                     for x, y in zip(eo, en))
    nodes = sum(g.nodes.shape[0] for g in graphs)
    print(f"histories={len(graphs)} sessions={args.sessions} nodes/history={nodes / len(graphs):.0f} "
          f"cards/history={sum(g.n_cards for g in graphs) / len(graphs):.0f} dim={args.dim} k={args.k}")
    print(f"dense {t_old / len(graphs):.3f} CPU s/history  blocked {t_new / len(graphs):.3f} CPU s/history  "
          f"ratio {t_old / t_new:.2f}x  identical={same} edges_identical={same_edges}")
    if not (same and same_edges):
        raise SystemExit("the dense and blocked card-graph searches differ")


if __name__ == "__main__":
    main()
