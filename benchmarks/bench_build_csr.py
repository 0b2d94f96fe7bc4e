"""The graph's CSR (`kernels/ppr.py: build_csr`): the direct construction against scipy's COO -> CSR with
sum_duplicates (the construction it replaced, the tests' oracle, as the baseline), in the same run, on the same edges.

Random undirected edges among ``--nodes`` nodes (``--edges`` of them, a tenth repeated reversed, some
self-loops), as the associate stage stores them for one history: at 10^6 sessions, 4 x 10^6 nodes and ~35 M
stored edges. Each construction runs in a child process of its own, so that its peak memory (``ru_maxrss``,
minus the child's RSS before it starts) is its own; the arrays are compared byte for byte.

    .venv/bin/python benchmarks/bench_build_csr.py --nodes 4000000 --edges 35000000
"""
from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
from test_ppr import scipy_csr  # noqa: E402  (the construction build_csr replaced: the tests' oracle)


def edges(n: int, m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    s, t = rng.integers(0, n, m), rng.integers(0, n, m)
    k = m // 10
    return np.r_[s, t[:k]], np.r_[t, s[:k]]


def child(which: str, n: int, m: int, seed: int) -> dict:
    from memgas.kernels.ppr import build_csr

    src, dst = edges(n, m, seed)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    A = build_csr(src, dst, n) if which == "direct" else scipy_csr(src, dst, n)
    wall = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    digest = hashlib.blake2b(digest_size=16)
    for a in (A.data, A.indices, A.indptr):
        digest.update(str(a.dtype).encode())
        digest.update(a.tobytes())
    return {"which": which, "wall_s": wall, "peak_extra_gb": (peak - before) / 2**20, "nnz": int(A.nnz),
            "digest": digest.hexdigest()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4_000_000)
    ap.add_argument("--edges", type=int, default=35_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.nodes, args.edges, args.seed)))
        return
    out = {}
    for which in ("scipy", "direct"):
        p = subprocess.run([sys.executable, __file__, "--child", which, "--nodes", str(args.nodes), "--edges",
                            str(args.edges), "--seed", str(args.seed)], capture_output=True, text=True, check=True)
        out[which] = json.loads(p.stdout.strip().splitlines()[-1])
    s, d = out["scipy"], out["direct"]
    print(f"{args.nodes:,} nodes, {args.edges:,} edges (+10% reversed), {d['nnz']:,} CSR entries")
    print("| construction | wall s | peak memory above the edges, GB |")
    print("|---|---|---|")
    for r in (s, d):
        print(f"| {r['which']} | {r['wall_s']:.2f} | {r['peak_extra_gb']:.2f} |")
    print(f"direct vs scipy: {s['wall_s'] / d['wall_s']:.2f}x faster, {s['peak_extra_gb'] / max(d['peak_extra_gb'], 1e-9):.2f}x "
          f"less peak memory; identical arrays: {s['digest'] == d['digest']}")
    if s["digest"] != d["digest"]:
        sys.exit("the two constructions differ")


if __name__ == "__main__":
    main()
