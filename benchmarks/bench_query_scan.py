"""One question's similarities over a long history's node rows, the scan that bounds a query's latency.

A history of ``--sessions`` sessions (4 node rows each, d = 384, seeded) is spilled to ``.npy`` block files as
the latency probe spills it (``NodeFile`` handles in ``NodeBlocks``). Each question's float64 similarities
(``PreparedGraph.similarities`` of one query, a ``gemv`` over every row) are computed three ways:

- ``before``: the scan of the code before (its loop is copied below, as the baseline): every
  ``SIM_BLOCK_ROWS`` span read with a copy (``NodeBlocks[lo:hi]``: ``np.fromfile`` of the block, then a slice
  copy), converted to float64 in a span-wide buffer, one ``gemv`` per span;
- ``now, 1 thread``: today's scan (rows read through the files' memory maps, converted ``GEMV_ROWS`` rows at a
  time in cache);
- ``now, N threads``: the same, its blocks shared by ``--threads`` threads (default: this process's cores).

The three must give the same bits for every question (the bench exits 1 otherwise); it prints each one's
median and worst time per question over ``--queries`` questions (after one warm-up question each, so the
files are in the page cache for all three) and the ratios against ``before``.

    .venv/bin/python benchmarks/bench_query_scan.py --sessions 1000000 --queries 10
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

DIM = 384


def spill_history(directory: Path, n_rows: int, seed: int) -> Any:
    """Seeded float32 node rows in block files of ``BLOCK_ROWS`` rows, as ``NodeBlocks`` of ``NodeFile``s."""
    from memgas.pipeline.association.blocks import BLOCK_ROWS, NodeBlocks
    from memgas.pipeline.association.nodes import NodeFile

    rng = np.random.default_rng(seed)
    files = []
    for i, lo in enumerate(range(0, n_rows, BLOCK_ROWS)):
        rows = rng.standard_normal((min(BLOCK_ROWS, n_rows - lo), DIM), dtype=np.float32)
        np.save(directory / f"{i}.npy", rows)
        files.append(NodeFile(directory / f"{i}.npy"))
    return NodeBlocks(files, BLOCK_ROWS, n_rows, DIM)


def similarities_before(nodes: Any, q: np.ndarray) -> np.ndarray:
    """The baseline: ``PreparedGraph.similarities`` before the scan read rows in place (its loop, copied)."""
    from memgas.pipeline.prepared import row_spans

    q64 = q.astype(np.float64)
    spans = row_spans(nodes.shape[0])
    out = np.empty((q.shape[0], nodes.shape[0]), np.float64)
    buf = np.empty((max(hi - lo for lo, hi in spans), nodes.shape[1]), np.float64)
    for lo, hi in spans:
        blk = buf[: hi - lo]
        blk[...] = nodes[lo:hi]
        out[:, lo:hi] = q64 @ blk.T
    return out


def timed(fn: Any, queries: np.ndarray) -> tuple[list[float], str]:
    """Seconds per question (the first question a warm-up, not counted) and a digest of every question's bits."""
    fn(queries[:1])
    times, h = [], hashlib.sha256()
    for i in range(queries.shape[0]):
        t = time.perf_counter()
        s = fn(queries[i : i + 1])
        times.append(time.perf_counter() - t)
        h.update(np.ascontiguousarray(s).tobytes())
    return times, h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=250_000, help="sessions of the history (4 node rows each)")
    p.add_argument("--queries", type=int, default=10, help="questions timed per way (after one warm-up)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads of the last way")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmp", default=None, help="directory for the block files (default: the temporary one)")
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args(argv)
    if args.sessions < 1 or args.queries < 1 or args.threads < 1:
        p.error("--sessions, --queries and --threads must be >= 1")

    from memgas.kernels.backend import one_blas_thread
    from memgas.pipeline.prepared import PreparedGraph

    n_rows = 4 * args.sessions
    queries = np.random.default_rng(args.seed + 1).standard_normal((args.queries, DIM), dtype=np.float32)
    result: dict[str, Any] = {"sessions": args.sessions, "node_rows": n_rows, "queries": args.queries}
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="bench-query-scan-") as d, one_blas_thread():
        nodes = spill_history(Path(d), n_rows, args.seed)
        ways = {"before": lambda q: similarities_before(nodes, q),
                "now, 1 thread": PreparedGraph(nodes).similarities,
                f"now, {args.threads} threads": PreparedGraph(nodes, scan_threads=args.threads).similarities}
        for name, fn in ways.items():
            times, digest = timed(fn, queries)
            result[name] = {"median_s": statistics.median(times), "max_s": max(times), "digest": digest}
    base = result["before"]["median_s"]
    same = len({result[w]["digest"] for w in ways}) == 1
    print(f"{args.sessions:,} sessions ({n_rows:,} node rows, d = {DIM}), {args.queries} questions, one at a time")
    print(f"{'way':<22} {'median s':>9} {'max s':>7} {'speed-up':>9}")
    for w in ways:
        r = result[w]
        print(f"{w:<22} {r['median_s']:>9.3f} {r['max_s']:>7.3f} {base / r['median_s']:>8.2f}x")
    print(f"bits identical in all three ways: {same}")
    result["bits_identical"] = same
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
