"""Huge histories: one history of 10^4 / 10^5 / 10^6 sessions (4 nodes each, d=384, clustered synthetic
vectors from ``memgas.pipeline.synth_vectors``, no encoder), vectors read from a ``.npy`` file in blocks.

Per size, each in its own process (so peak RSS is that size's):
- build: approximate association over all rows, ``--search hnsw`` (``associate_hnsw``, faiss HNSW, fp16
  store) or ``--search ivf`` (``associate_ivf``, faiss IVF, SQ8 store, centroids trained on a prefix); exact
  association (``associate_rows``, the causal row-block search) over all rows where affordable
  (``--exact-max-sessions``), else over a sample of row tiles, extrapolated by the causal work
  (sum over rows of the prefix length), labelled as such. Ratio: approximate vs exact on the same rows.
- append 1,000 sessions (new rows only): exact with ``associate_rows`` on the new rows (above
  ``--append-exact-max-sessions``: on two sampled row tiles, extrapolated by the causal work, labelled);
  approximate with the saved index (``CausalHNSW.load`` / ``CausalIVF.load``). Correctness: the new rows
  split in two row blocks give the same exact candidates as one block, byte for byte; with IVF, up to
  ``--fresh-max-sessions``, the append's candidates equal a fresh IVF build over the longer history's.
- candidate recall@30 of the approximate search against exact search on the sampled rows; edge overlap.
- query latency p50/p95 of router + seeds + PPR (``kernels.router.entropy_router``,
  ``pipeline.retrieve.seed_reset``, ``kernels.ppr.personalized_pagerank``) per query, with the graph's CSR
  built once (an index-time artefact); checked equal to ``pipeline.retrieve.score_with_edges`` on the
  first queries where that function fits in memory.
- GPU column: an estimate only: the exact search's FLOPs at the H200's FP32 peak vs the CPU's measured
  sgemm rate (never measured here).

    python benchmarks/bench_huge_history.py --sizes 10000,100000 [--search ivf] [--append 1000] [--queries 32]

``--through-job``: the same history through the job's commands instead (``memgas ingest``, ``index`` with
``association.search=ivf``, ``answer`` with ``retrieval.ppr=push`` and ``exact``, ``ingest --append``), each
measured as a child process: see ``benchmarks/huge_history_job.py``.

    python benchmarks/bench_huge_history.py --through-job --sizes 10000 [--append 1000] [--queries 200]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import huge_history_job  # the --through-job mode (a sibling module: benchmarks/ is on sys.path when run)
import numpy as np
from memgas.pipeline.association import HNSWParams, IVFParams

A_DEFAULTS = HNSWParams()  # the bench's HNSW defaults are the library's (one place)
I_DEFAULTS = IVFParams()
H200_FP32_FLOPS = 67e12  # NVIDIA H200 SXM peak FP32 (non-tensor); the exact search is float32 sgemm
N_GRAN = 4


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def sgemm_rate() -> float:
    """Measured float32 FLOP/s of one causal tile product (256 x 65536 x 384), best of 3."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((256, 384), dtype=np.float32)
    c = rng.standard_normal((1 << 16, 384), dtype=np.float32)
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        q @ c.T
        best = min(best, time.perf_counter() - t)
    return 2 * 256 * (1 << 16) * 384 / best


def causal_work(rows: np.ndarray) -> float:
    """Prefix columns summed over rows: the exact search's work is proportional to it."""
    return float(((rows // N_GRAN) * N_GRAN).sum())


def sample_tiles(n_nodes: int, n_tiles: int, start: int, tile: int = 256) -> list[tuple[int, int]]:
    """``n_tiles`` whole row tiles spread evenly over ``[start, n_nodes)`` (tile-aligned)."""
    first, last = -(-start // tile), n_nodes // tile
    picks = sorted({int(t) for t in np.linspace(first, last - 1, n_tiles)})
    return [(max(start, t * tile), min(n_nodes, (t + 1) * tile)) for t in picks]


def query_latency(nf, src, dst, n_queries: int, seed: int = 0, num_seeds: int = 15, damping: float = 0.1,
                  temp: float = 0.2, check: int = 0) -> dict:
    """Per-query latency of router + seeds + PPR + session order; the CSR is built once (timed apart)."""
    from memgas.kernels.ppr import build_csr, personalized_pagerank
    from memgas.kernels.router import entropy_router
    from memgas.kernels.segment import segment_sum_contiguous
    from memgas.kernels.topk import stable_argsort_desc
    from memgas.pipeline.retrieve import score_with_edges, seed_reset

    n, d = nf.shape
    S = n // N_GRAN
    rng = np.random.default_rng(seed)
    picks = np.sort(rng.choice(n, n_queries, replace=False))
    q = nf[picks] + 0.05 * rng.standard_normal((n_queries, d)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    t = time.perf_counter()
    adj = build_csr(src, dst, n)
    t_csr = time.perf_counter() - t
    block = 1 << 18
    lat, orders = [], []
    for i in range(n_queries):
        t = time.perf_counter()
        qi = q[i : i + 1].astype(np.float64)
        sims = np.empty((1, n))
        for a in range(0, n, block):  # float64 similarities, node vectors read in blocks
            sims[:, a : a + block] = qi @ nf[a : a + block].astype(np.float64).T
        w, _ = entropy_router([sims[:, g::N_GRAN] for g in range(N_GRAN)], temp=temp, rule="paper")
        reset = seed_reset(sims * np.tile(w, (1, S)), num_seeds)
        ppr = personalized_pagerank(adj, reset, damping)
        order = stable_argsort_desc(segment_sum_contiguous(ppr, N_GRAN))
        lat.append(time.perf_counter() - t)
        orders.append(order[0])
    same = None
    if check:  # same top-10 sessions as score_with_edges (its one [Q, n] float64 product rounds differently)
        E = nf[0:n]
        ref, _ = score_with_edges(E, q[:check], src, dst, num_seeds=num_seeds, damping=damping, temp=temp)
        same = bool(all(np.array_equal(ref[j][:10], orders[j][:10]) for j in range(check)))
    lat_ms = 1e3 * np.array(lat)
    return {"csr_s": t_csr, "p50_ms": float(np.percentile(lat_ms, 50)), "p95_ms": float(np.percentile(lat_ms, 95)),
            "queries": n_queries, "edges": int(src.size), "top10_same_as_score_with_edges": same}


def make_index(args: argparse.Namespace):
    """A fresh approximate index of the kind ``--search`` names, with the bench's parameters."""
    from memgas.pipeline import association as A

    if args.search == "ivf":
        return A.CausalIVF(args.dim, ivf_params(args))
    return A.CausalHNSW(args.dim, hnsw_params(args))


def hnsw_params(args: argparse.Namespace) -> HNSWParams:
    return HNSWParams(store=args.store or A_DEFAULTS.store, threads=args.threads, block_sessions=args.hnsw_block,
                      m=args.m, ef_construction=args.ef_construction, ef_search=args.ef_search)


def ivf_params(args: argparse.Namespace) -> IVFParams:
    return IVFParams(store=args.store or I_DEFAULTS.store, nlist=args.nlist, nprobe=args.nprobe,
                     block_sessions=args.ivf_block, train_nodes=args.train_nodes, exact_nodes=args.exact_nodes)


def approx_blocks(index, nf, rows: np.ndarray, k: int):
    """``(sel, Candidates)`` per block of rows from either index (HNSW blocks are rescored here; IVF
    blocks come rescored)."""
    from memgas.pipeline import association as A

    for item in index.blocks(nf, rows, k):
        if len(item) == 2:
            yield item
        else:
            sel, cand, valid = item
            yield sel, A.Candidates(rows[sel], *A._rescore(nf, rows[sel], cand, valid))


def approx_build(index, nf, rows: np.ndarray, k: int, keep: np.ndarray) -> tuple:
    """All rows' edges (GMM accept per block) and the candidates of the rows ``keep``; progress on stderr."""
    from memgas.pipeline import association as A

    parts, kept = [], {}
    t, last = time.perf_counter(), 0.0
    for sel, c in approx_blocks(index, nf, rows, k):
        parts.append(A._edges(c, A._accept([c], "gmm", None, "cpu")[0]))
        for j in np.flatnonzero(np.isin(c.rows, keep)).tolist():
            kept[int(c.rows[j])] = c.cand[j][c.valid[j]]
        el = time.perf_counter() - t
        if el - last > 60:
            last = el
            print(f"  build: {int(sel[-1]) + 1:,}/{rows.size:,} rows, {el:.0f} s", file=sys.stderr, flush=True)
    return A.concat_edges(parts), kept


def recall(truth: list, kept: dict) -> list[float]:
    """Candidate recall@k per row with a non-empty exact list (``truth``: exact Candidates)."""
    rec = []
    for c in truth:
        for j, r in enumerate(c.rows.tolist()):
            t = set(c.cand[j][c.valid[j]].tolist())
            if t:
                rec.append(len(t & set(kept[r].tolist())) / len(t))
    return rec


def run_size(S: int, args: argparse.Namespace, tmp: Path) -> dict:
    from memgas.pipeline import association as A
    from memgas.pipeline.synth_vectors import write_nodes

    k, mp = 30, 20
    n_app = args.append
    path = tmp / f"nodes_{S}.npy"
    t = time.perf_counter()
    write_nodes(path, S + n_app, dim=args.dim, n_topics=args.topics, seed=0)
    gen_s = time.perf_counter() - t
    nf = A.NodeFile(path, n_nodes=N_GRAN * S)  # the history before the append
    nf_all = A.NodeFile(path)  # after
    n = N_GRAN * S
    out: dict = {"sessions": S, "nodes": n, "generate_s": gen_s, "search": args.search}
    out["params"] = {"hnsw": hnsw_params(args), "ivf": ivf_params(args)}[args.search].__dict__
    first = A._first_row_session(0, mp) * N_GRAN
    sample = sample_tiles(n, args.sample_tiles, first)
    sample_rows = np.concatenate([np.arange(a, b) for a, b in sample])
    a0, a1 = n, N_GRAN * (S + n_app)
    app_tiles = sample_tiles(a1, 2, a0)
    app_rows = np.concatenate([np.arange(a, b) for a, b in app_tiles])

    # -- approximate build (all rows), keeping the sampled rows' candidates for recall ----------------------
    t = time.perf_counter()
    index = make_index(args)
    approx_edges, kept = approx_build(index, nf, np.arange(first, n, dtype=np.int64), k, sample_rows)
    out["approx_build_s"] = time.perf_counter() - t
    out["approx_edges"] = int(approx_edges.src.size)
    out["approx_build_rss_gb"] = peak_rss_gb()
    idx_path = tmp / f"{args.search}_{S}.faiss"
    index.save(idx_path)
    out["index_gb"] = idx_path.stat().st_size / 2**30
    del index

    # -- exact on the sample (recall ground truth; cost per unit of causal work) ---------------------------
    t = time.perf_counter()
    ex = [A.causal_rows(nf, a, b) for a, b in sample]
    t_sample = time.perf_counter() - t
    rec = recall(ex, kept)
    out["recall_at_30"] = float(np.mean(rec))
    out["recall_rows"] = len(rec)
    out["recall_p05"] = float(np.percentile(rec, 5))
    total_work = causal_work(np.arange(first, n))
    sample_work = causal_work(sample_rows)
    out["exact_extrapolated_s"] = t_sample * total_work / max(sample_work, 1.0)
    out["exact_flops"] = 2.0 * args.dim * total_work

    # -- exact build over all rows where affordable ---------------------------------------------------------
    if S <= args.exact_max_sessions:
        t = time.perf_counter()
        exact_edges = A.concat_edges([A.associate_rows(nf, a, b) for a, b in A.split_rows(n, 4, start=first)])
        out["exact_build_s"] = time.perf_counter() - t
        ea = set(zip(approx_edges.src.tolist(), approx_edges.dst.tolist()))
        ee = set(zip(exact_edges.src.tolist(), exact_edges.dst.tolist()))
        out["exact_edges"] = len(ee)
        out["edge_recall"] = len(ea & ee) / max(len(ee), 1)
        out["edge_precision"] = len(ea & ee) / max(len(ea), 1)
        del exact_edges, ea, ee
    out["rss_after_exact_gb"] = peak_rss_gb()

    # -- append: approximate with the saved index (all new rows, measured) ----------------------------------
    t = time.perf_counter()
    idx = (A.CausalIVF.load(idx_path, ivf_params(args)) if args.search == "ivf"
           else A.CausalHNSW.load(idx_path, hnsw_params(args)))
    app_kept = {}
    parts = []
    for sel, c in approx_blocks(idx, nf_all, np.arange(a0, a1, dtype=np.int64), k):
        parts.append(A._edges(c, A._accept([c], "gmm", None, "cpu")[0]))
        for j in np.flatnonzero(np.isin(c.rows, app_rows)).tolist():
            app_kept[int(c.rows[j])] = c.cand[j][c.valid[j]]
    app_a = A.concat_edges(parts)
    out["append_approx_s"] = time.perf_counter() - t
    out["append_approx_edges"] = int(app_a.src.size)
    del idx
    if args.search == "ivf" and S <= args.fresh_max_sessions:
        # the append over the saved index == a fresh build over the longer history (same training prefix)
        fresh, _ = A.associate_ivf(nf_all, ivf=ivf_params(args))
        new = fresh.src >= a0
        out["append_equals_fresh_build"] = all(
            getattr(app_a, f).tobytes() == getattr(fresh, f)[new].tobytes() for f in ("src", "dst", "sim"))
        del fresh

    # -- append: exact new rows (row-block function), all of them or sampled tiles --------------------------
    t = time.perf_counter()
    if S <= args.append_exact_max_sessions:
        app = A.associate_rows(nf_all, a0, a1)
        out["append_exact_s"] = time.perf_counter() - t
        out["append_edges"] = int(app.src.size)
        ae = set(zip(app.src.tolist(), app.dst.tolist()))
        out["append_edge_recall"] = len(ae & set(zip(app_a.src.tolist(), app_a.dst.tolist()))) / max(len(ae), 1)
        # correctness on the same inputs: the first new rows in two blocks == in one block, byte for byte
        m = min(a1, a0 + 256)
        one = A.causal_rows(nf_all, a0, m)
        two = [A.causal_rows(nf_all, a0, a0 + 101), A.causal_rows(nf_all, a0 + 101, m)]
        out["append_split_identical"] = all(
            np.concatenate([getattr(c, f) for c in two]).tobytes() == getattr(one, f).tobytes()
            for f in ("cand", "valid", "scores"))
    else:
        app_ex = [A.causal_rows(nf_all, a, b) for a, b in app_tiles]
        dt = time.perf_counter() - t
        out["append_exact_sample_rows"] = int(app_rows.size)
        out["append_exact_extrapolated_s"] = dt * causal_work(np.arange(a0, a1)) / causal_work(app_rows)
        out["append_recall_at_30_sampled"] = float(np.mean(recall(app_ex, app_kept)))

    # -- queries: router + seeds + PPR on the approximate graph ---------------------------------------------
    out["query"] = query_latency(nf, approx_edges.src, approx_edges.dst, args.queries,
                                 check=3 if n <= 500_000 else 0)
    out["peak_rss_gb"] = peak_rss_gb()
    rate = sgemm_rate()
    out["cpu_sgemm_gflops"] = rate / 1e9
    out["gpu_exact_estimate_s"] = out["exact_flops"] / H200_FP32_FLOPS
    out["cpu_exact_at_measured_rate_s"] = out["exact_flops"] / rate
    path.unlink(missing_ok=True)
    idx_path.unlink(missing_ok=True)
    return out


def sample_size(S: int, args: argparse.Namespace, tmp: Path) -> dict:
    """Sizes too long to build here: the exact append's cost measured on a sample of the new rows (whole
    256-row tiles against the real prefix, vectors read from the file) and extrapolated to all new rows;
    memory of the approximate index extrapolated from its bytes per node (see the docs)."""
    from memgas.pipeline import association as A
    from memgas.pipeline.synth_vectors import write_nodes

    path = tmp / f"nodes_{S}.npy"
    t = time.perf_counter()
    write_nodes(path, S + args.append, dim=args.dim, n_topics=args.topics, seed=0)
    out: dict = {"sessions": S, "nodes": N_GRAN * S, "generate_s": time.perf_counter() - t, "sampled": True}
    nf_all = A.NodeFile(path)
    a0, a1 = N_GRAN * S, N_GRAN * (S + args.append)
    tiles = sample_tiles(a1, 2, a0)
    t = time.perf_counter()
    for a, b in tiles:
        A.causal_rows(nf_all, a, b)
    dt = time.perf_counter() - t
    rows = np.concatenate([np.arange(a, b) for a, b in tiles])
    out["append_exact_sample_rows"] = int(rows.size)
    out["append_exact_extrapolated_s"] = dt * causal_work(np.arange(a0, a1)) / causal_work(rows)
    out["exact_flops"] = 2.0 * args.dim * causal_work(np.arange(20, a0))
    out["peak_rss_gb"] = peak_rss_gb()
    rate = sgemm_rate()
    out["cpu_sgemm_gflops"] = rate / 1e9
    out["gpu_exact_estimate_s"] = out["exact_flops"] / H200_FP32_FLOPS
    out["cpu_exact_at_measured_rate_s"] = out["exact_flops"] / rate
    path.unlink(missing_ok=True)
    return out


def table(results: list[dict]) -> str:
    def h(s: float) -> str:
        return f"{s / 3600:.2f} h" if s >= 3600 else (f"{s / 60:.1f} min" if s >= 120 else f"{s:.1f} s")

    lines = [("| sessions | search | approx build | exact build | approx/exact | append 1k exact | append 1k approx | "
              "recall@30 | edges kept | query p50 / p95 | peak RSS | GPU exact (estimate) |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("sampled"):
            lines.append(f"| {r['sessions']:,} | - | (not built here) | - | - | ~{h(r['append_exact_extrapolated_s'])} "
                         f"(sampled {r['append_exact_sample_rows']} rows) | - | - | - | - | "
                         f"{r['peak_rss_gb']:.2f} GB (sample) | {h(r['gpu_exact_estimate_s'])} |")
            continue
        ex = r.get("exact_build_s")
        ex_s = h(ex) if ex is not None else f"~{h(r['exact_extrapolated_s'])} (extrapolated)"
        base = ex if ex is not None else r["exact_extrapolated_s"]
        edge = f"{100 * r['edge_recall']:.1f}%" if "edge_recall" in r else "-"
        q = r["query"]
        app_ex = (h(r["append_exact_s"]) if "append_exact_s" in r
                  else f"~{h(r['append_exact_extrapolated_s'])} (sampled {r['append_exact_sample_rows']} rows)")
        lines.append(
            f"| {r['sessions']:,} | {r.get('search', 'hnsw')} | {h(r['approx_build_s'])} | {ex_s} | "
            f"{r['approx_build_s'] / base:.2f} | "
            f"{app_ex} | {h(r['append_approx_s'])} | {r['recall_at_30']:.4f} | {edge} | "
            f"{q['p50_ms']:.0f} / {q['p95_ms']:.0f} ms | {r['peak_rss_gb']:.2f} GB | "
            f"{h(r['gpu_exact_estimate_s'])} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000", help="comma-separated session counts")
    ap.add_argument("--append", type=int, default=1000, help="sessions appended")
    ap.add_argument("--queries", type=int, default=None, help="default 32; --through-job: 200")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--topics", type=int, default=1000)
    ap.add_argument("--search", default="hnsw", choices=["hnsw", "ivf"], help="approximate search")
    ap.add_argument("--store", default=None, choices=["flat", "fp16", "sq8"], help="default: the search's own")
    ap.add_argument("--nlist", type=int, default=I_DEFAULTS.nlist, help="IVF lists")
    ap.add_argument("--nprobe", type=int, default=I_DEFAULTS.nprobe, help="IVF lists searched per row")
    ap.add_argument("--ivf-block", type=int, default=I_DEFAULTS.block_sessions, help="sessions per IVF block")
    ap.add_argument("--train-nodes", type=int, default=I_DEFAULTS.train_nodes, help="IVF training prefix")
    ap.add_argument("--exact-nodes", type=int, default=I_DEFAULTS.exact_nodes, help="IVF: rows searched exactly")
    ap.add_argument("--m", type=int, default=A_DEFAULTS.m, help="HNSW links per node")
    ap.add_argument("--ef-construction", type=int, default=A_DEFAULTS.ef_construction)
    ap.add_argument("--ef-search", type=int, default=A_DEFAULTS.ef_search)
    ap.add_argument("--threads", type=int, default=2, help="faiss threads while adding to the HNSW index")
    ap.add_argument("--hnsw-block", type=int, default=1024, help="sessions per HNSW search/add block")
    ap.add_argument("--sample-tiles", type=int, default=8, help="row tiles (256 rows) for exact recall/timing")
    ap.add_argument("--exact-max-sessions", type=int, default=20_000, help="exact build over all rows up to this")
    ap.add_argument("--append-exact-max-sessions", type=int, default=100_000,
                    help="exact append over all new rows up to this, else on 2 sampled tiles")
    ap.add_argument("--fresh-max-sessions", type=int, default=20_000,
                    help="IVF: check the append against a fresh build up to this")
    ap.add_argument("--tmp", default=None, help="directory for the vector files (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--sample-only", action="store_true", help="sizes too long to build: sampled append only")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--through-job", action="store_true", help="through the job's commands (huge_history_job.py)")
    huge_history_job.add_args(ap)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.through_job:
        args.queries = args.queries or 200
        huge_history_job.main(args)
        return
    args.queries = args.queries or 32
    if args.one is not None:  # child: one size, JSON on stdout's last line
        if args.tmp:
            Path(args.tmp).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=args.tmp) as d:
            f = sample_size if args.sample_only else run_size
            print(json.dumps(f(args.one, args, Path(d))), flush=True)
        return
    results = []
    for S in [int(x) for x in args.sizes.split(",")]:
        cmd = [sys.executable, __file__, "--one", str(S), *(sys.argv[1:] if argv is None else argv)]
        t = time.perf_counter()
        p = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, text=True, env=os.environ)  # progress: stderr
        if p.returncode:
            sys.exit(f"size {S} failed (its stderr is above)")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["wall_s"] = time.perf_counter() - t
        results.append(r)
        print(json.dumps(r), flush=True)
    print(table(results))
    for r in [r for r in results if not r.get("sampled")]:
        print(f"{r['sessions']:,} sessions: approx vs exact build x{r['approx_build_s'] / (r.get('exact_build_s') or r['exact_extrapolated_s']):.3f}"
              f" ({'measured' if 'exact_build_s' in r else 'exact extrapolated from a sample'}); "
              f"append split identical: {r.get('append_split_identical')}; "
              f"append == fresh build: {r.get('append_equals_fresh_build')}; "
              f"query top-10 == score_with_edges: {r['query']['top10_same_as_score_with_edges']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    checks = ("append_split_identical", "append_equals_fresh_build")
    failed = [r["sessions"] for r in results if not r.get("sampled") and False in (
        *(r.get(c) for c in checks), r["query"]["top10_same_as_score_with_edges"])]
    if failed:
        sys.exit(f"a correctness check failed at {failed} sessions (the lines above)")


if __name__ == "__main__":
    main()
