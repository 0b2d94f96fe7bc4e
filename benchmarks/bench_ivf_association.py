"""The associate stage's IVF search on real and synthetic node vectors: recall and cost.

Real vectors: the unique sessions of a `memgas index` bank (e.g. configs/longmemeval_s.yaml on the
LongMemEval-S sample, MiniLM), read as the stage reads them (session and turn-pair vectors under their
window key, the turn node the mean of its pairs, summary and keyword under the main key), in history and
position order, each unique session once: one long history of real MiniLM nodes. Sessions whose vectors
are not all encoded yet are left out (a partial encode still gives whole sessions). Synthetic vectors:
``memgas.pipeline.synth_vectors.clustered_nodes``.

For each (exact prefix, nlist, nprobe) it runs the stage's search (``ivf_search.ivf_rows`` with
``stage_params``) on the rows past the prefix and reports the candidate recall@30 against the exact search
(the stage's measure, on every row past the prefix up to --sample rows) and both searches' seconds::

    python benchmarks/bench_ivf_association.py --bank /tmp/lme/bank --exact-nodes 1024 --nlist 26 --nprobe 1,2,4
    python benchmarks/bench_ivf_association.py --synthetic 4300 --exact-nodes 1024 --nlist 26 --nprobe 1,2,4
    python benchmarks/bench_ivf_association.py --timing 16384,65536 --rows 2048   # per-row cost, exact vs IVF
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from memgas.kernels.backend import one_blas_thread
from memgas.pipeline.association import ivf_search as I
from memgas.pipeline.association.exact_search import causal_rows
from memgas.pipeline.bank import Bank
from memgas.pipeline.granularity import _vectors
from memgas.pipeline.synth_vectors import clustered_nodes


def bank_nodes(path: Path) -> tuple[np.ndarray, int]:
    """[4*S, d] real node vectors of the bank's unique, completely encoded sessions, and S dropped."""
    bank = Bank(path)
    emb = bank.read("embeddings", ["text_hash", "encoder", "vector"])
    vec = _vectors(emb)
    by: dict[tuple[str, str], int] = {}
    for i, (h, k) in enumerate(zip(emb["text_hash"].to_pylist(), emb["encoder"].to_pylist())):
        by[(k, h)] = i
    keys = sorted(set(emb["encoder"].to_pylist()))
    main = next(k for k in keys if "~" not in k)
    window = next((k for k in keys if "~" in k), main)  # sessions and pairs (one window in the config)
    nodes = bank.read("nodes").sort_by([("history_id", "ascending"), ("position", "ascending")])
    pairs = bank.read("pairs", ["session_hash", "pair_index", "text_hash"])
    pair_of: dict[str, list[str]] = {}
    for s, t in zip(pairs["session_hash"].to_pylist(), pairs["text_hash"].to_pylist()):
        pair_of.setdefault(s, []).append(t)
    sess: dict[tuple[str, int], dict[str, str]] = {}
    for h, p, g, t in zip(*(nodes[c].to_pylist() for c in ("history_id", "position", "granularity", "text_hash"))):
        sess.setdefault((h, p), {})[g] = t
    out, seen, dropped = [], set(), 0
    for _, g in sorted(sess.items()):
        if g.get("session") in seen:
            continue
        seen.add(g.get("session"))
        try:
            pv = [vec[by[(window, t)]] for t in pair_of.get(g["session"], [])]
            row = [vec[by[(window, g["session"])]], np.mean(pv, 0) if pv else vec[by[(window, g["session"])]],
                   vec[by[(main, g["summary"])]], vec[by[(main, g["keyword"])]]]
        except KeyError:
            dropped += 1
            continue
        out.append(np.stack(row))
    return np.concatenate(out).astype(np.float32), dropped


def recall_run(E: np.ndarray, exact_nodes: int, nlist: int, nprobe: int, sample: int, k: int = 30) -> dict:
    p = I.stage_params(nlist, nprobe, exact_nodes)
    n = E.shape[0]
    with one_blas_thread():
        t0 = time.perf_counter()
        c, index = I.ivf_rows(E, exact_nodes, n, None, mem_threshold=k, min_prior_nodes=20, params=p)
        t_ivf = time.perf_counter() - t0
        rows = c.rows
        pick = rows if rows.size <= sample else np.sort(np.random.default_rng(29).choice(rows, sample, replace=False))
        hits, total = I.candidate_recall(E, c, pick, k)
        t0 = time.perf_counter()
        causal_rows(E, exact_nodes, n, mem_threshold=k, min_prior_nodes=20)
        t_exact = time.perf_counter() - t0
    return {"nodes": n, "exact_nodes": exact_nodes, "nlist": index.nlist, "nprobe": nprobe, "rows": int(rows.size),
            "sampled": int(pick.size), "recall": hits / total if total else None, "ivf_s": round(t_ivf, 2),
            "exact_s": round(t_exact, 2)}


def timing_run(n0: int, rows: int, nlist: int, nprobe: int, dim: int) -> dict:
    """Seconds of the rows [n0, n0 + rows) of a synthetic history: exact, and IVF (training on the n0
    prefix and filling the index counted apart)."""
    E = clustered_nodes(0, (n0 + rows) // 4, dim=dim)
    p = I.stage_params(nlist, nprobe, n0)
    with one_blas_thread():
        t0 = time.perf_counter()
        causal_rows(E, n0, n0 + rows)
        t_exact = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, ix = I.ivf_rows(E[:n0 + 4], n0, n0 + 4, None, params=p)  # trains and fills the prefix (one row)
        t_setup = time.perf_counter() - t0
        t0 = time.perf_counter()
        I.ivf_rows(E, n0, n0 + rows, None, params=p)
        t_all = time.perf_counter() - t0
    return {"prefix_nodes": n0, "rows": rows, "nlist": ix.nlist, "nprobe": nprobe, "exact_s_per_row": t_exact / rows,
            "ivf_setup_s": round(t_setup, 2), "ivf_s_per_row": max(0.0, t_all - t_setup) / rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bank", type=Path)
    ap.add_argument("--synthetic", type=int, help="sessions of a synthetic history")
    ap.add_argument("--npz", type=Path, help="real node vectors [S, 4, d] under key 'nodes' (tests/fixtures/"
                    "locomo_minilm_nodes.npz: LoCoMo's 272 sessions, MiniLM)")
    ap.add_argument("--bank-vectors", type=Path, help="every vector of a bank's embeddings (a partial encode too), "
                    "in text-hash order, 4 to a pseudo-session: real vectors without the node structure")
    ap.add_argument("--timing", help="prefix sizes in nodes (comma-separated): per-row cost, exact vs IVF")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--exact-nodes", type=int, default=1024)
    ap.add_argument("--nlist", type=int, default=2048)
    ap.add_argument("--nprobe", default="6")
    ap.add_argument("--sample", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=384)
    args = ap.parse_args(argv)
    probes = [int(x) for x in args.nprobe.split(",")]
    if args.timing:
        for n0 in (int(x) for x in args.timing.split(",")):
            for npr in probes:
                print(json.dumps(timing_run(n0, args.rows, args.nlist, npr, args.dim)), flush=True)
        return
    if args.npz:
        E = np.load(args.npz)["nodes"].reshape(-1, args.dim).astype(np.float32)
        print(json.dumps({"source": str(args.npz), "sessions": E.shape[0] // 4}))
    elif args.bank_vectors:
        emb = Bank(args.bank_vectors).read("embeddings", ["text_hash", "encoder", "vector"])
        emb = emb.sort_by([("encoder", "ascending"), ("text_hash", "ascending")])
        E = _vectors(emb)[: emb.num_rows // 4 * 4].astype(np.float32)
        print(json.dumps({"source": f"{args.bank_vectors} (every vector)", "sessions": E.shape[0] // 4}))
    elif args.bank:
        E, dropped = bank_nodes(args.bank)
        print(json.dumps({"source": str(args.bank), "sessions": E.shape[0] // 4, "sessions_not_encoded": dropped}))
    else:
        E = clustered_nodes(0, args.synthetic, dim=args.dim)
        print(json.dumps({"source": "synthetic", "sessions": args.synthetic}))
    for npr in probes:
        print(json.dumps(recall_run(E, args.exact_nodes, args.nlist, npr, args.sample)), flush=True)


if __name__ == "__main__":
    main()
