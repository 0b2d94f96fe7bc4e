"""The exact causal search on a sparse row set (the IVF candidate-recall sample): packed query blocks against
one block per tile, in the same run, on the same inputs.

A random normalised float32 matrix of ``--nodes`` x ``--dim`` nodes; ``--sample`` random rows among its last
``--window`` rows (``--window 0``: among all rows, as in a fresh build's unit). Both paths run with one BLAS
thread (as the job's tasks do) and their results are compared with ``np.array_equal``.

    .venv/bin/python benchmarks/bench_sparse_exact.py --nodes 400000 --window 4000
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from memgas.kernels.backend import one_blas_thread
from memgas.pipeline.association.exact_search import CAUSAL_BLOCK_SESSIONS, _causal_candidates, _query_blocks
from memgas.pipeline.association.nodes import MEM_THRESHOLD, N_GRAN


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=400_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--sample", type=int, default=256)
    ap.add_argument("--window", type=int, default=4000, help="sample among the last WINDOW rows (0: all rows)")
    ap.add_argument("--k", type=int, default=MEM_THRESHOLD)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    E = rng.standard_normal((args.nodes, args.dim), dtype=np.float32)
    E /= np.linalg.norm(E, axis=1, keepdims=True)
    lo = args.nodes - args.window if args.window else 0
    rows = np.sort(rng.choice(np.arange(lo, args.nodes), size=args.sample, replace=False)).astype(np.int64)
    T = CAUSAL_BLOCK_SESSIONS * N_GRAN
    tiles = np.unique(rows // T).size
    packs = len(_query_blocks(rows, T, pack=True))
    res = {}
    with one_blas_thread():
        for name, pack in (("per-tile", False), ("packed", True)):
            t0 = time.perf_counter()
            res[name] = (_causal_candidates(E, rows, args.k, "cpu", pack=pack), time.perf_counter() - t0)
    (oc, ov), t_old = res["per-tile"]
    (nc, nv), t_new = res["packed"]
    same = bool(np.array_equal(oc, nc) and np.array_equal(ov, nv))
    print(f"nodes={args.nodes} dim={args.dim} sample={rows.size} window={args.window or args.nodes} k={args.k} "
          f"tiles={tiles} query_blocks={packs}")
    print(f"per-tile {t_old:.2f} s  packed {t_new:.2f} s  ratio {t_old / t_new:.2f}x  identical={same}")
    if not same:
        raise SystemExit("packed and per-tile results differ")


if __name__ == "__main__":
    main()
