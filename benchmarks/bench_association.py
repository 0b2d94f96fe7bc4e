"""Association benchmark: batched candidate search + GMM vs the authors' per-node loop.

Baseline (the authors' approach): for each eligible node, NumPy similarities to earlier nodes, full sort,
top ``mem_threshold``, one scikit-learn ``GaussianMixture(2, random_state=0)`` fit, edges added to an
igraph graph. Ours: ``memgas.pipeline.association.associate_many`` (dense float32 top-k + one batched EM).

    python benchmarks/bench_association.py [--sessions 500] [--baseline-rows N] [--device cpu]
"""
from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "locomo_minilm_nodes.npz"


def synthetic_history(n_sessions: int = 500, dim: int = 384, n_topics: int = 60, seed: int = 0) -> np.ndarray:
    """[S, 4, d] unit vectors with topic structure (sessions share topics; granularities share sessions).

    Pairwise similarities land roughly where MiniLM's do (unrelated ~0-0.2, same topic ~0.3-0.7).
    """
    rng = np.random.default_rng(seed)
    topics = rng.normal(size=(n_topics, dim))
    topics /= np.linalg.norm(topics, axis=1, keepdims=True)
    t = rng.integers(0, n_topics, n_sessions)
    sess = topics[t] + 0.9 * rng.normal(size=(n_sessions, dim)) / np.sqrt(dim)
    nodes = sess[:, None, :] + 0.8 * rng.normal(size=(n_sessions, 4, dim)) / np.sqrt(dim)
    nodes /= np.linalg.norm(nodes, axis=-1, keepdims=True)
    return nodes.astype(np.float32)


def locomo_histories() -> list[np.ndarray]:
    f = np.load(FIXTURE, allow_pickle=False)
    nodes, off = f["nodes"].astype(np.float32), f["conv_offsets"]
    return [nodes[off[i] : off[i + 1]] for i in range(len(off) - 1)]


def baseline(hist: np.ndarray, mem_threshold: int = 30, min_prior_nodes: int = 20, max_rows: int | None = None):
    """Authors-style loop. Returns (accepted sets per row {row: frozenset}, seconds, rows done)."""
    import igraph as ig
    from sklearn.mixture import GaussianMixture

    E = hist.reshape(-1, hist.shape[-1]).astype(np.float32)
    n = E.shape[0]
    g = ig.Graph(n=n, directed=False)
    out = {}
    t0 = time.perf_counter()
    done = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(n):
            prior = (i // 4) * 4
            if prior < min_prior_nodes:
                continue
            if max_rows is not None and done >= max_rows:
                break
            sims = E[:prior] @ E[i]
            top = np.argsort(-sims, kind="stable")[:mem_threshold]
            x = (E[top].astype(np.float64) @ E[i].astype(np.float64))[:, None]
            gm = GaussianMixture(n_components=2, random_state=0).fit(x)
            acc = top[gm.predict(x) == int(np.argmax(gm.means_[:, 0]))]
            g.add_edges([(i, int(j)) for j in acc])
            out[i] = frozenset(acc.tolist())
            done += 1
    return out, time.perf_counter() - t0, done


def ours(hists: list[np.ndarray], device: str):
    from memgas.pipeline.association import associate_many

    t0 = time.perf_counter()
    edges = associate_many(hists, device=device)
    dt = time.perf_counter() - t0
    sets = []
    for e in edges:
        d: dict[int, set] = {}
        for s, t in zip(e.src.tolist(), e.dst.tolist()):
            d.setdefault(s, set()).add(t)
        sets.append(d)
    return sets, dt, edges


def compare(name: str, hists: list[np.ndarray], device: str, baseline_rows: int | None) -> tuple:
    ours_sets, t_ours, edges = ours(hists, device)
    t_base, same, total, rows_done = 0.0, 0, 0, 0
    total_rows = sum(max(0, h.shape[0] * 4 - 20) for h in hists)
    for h, mine in zip(hists, ours_sets):
        lim = None if baseline_rows is None else max(0, baseline_rows - rows_done)
        if lim == 0:
            break
        ref, dt, done = baseline(h, max_rows=lim)
        t_base += dt
        rows_done += done
        for r, acc in ref.items():
            total += 1
            same += acc == frozenset(mine.get(r, set()))
    # extrapolate the baseline to all rows when it ran on a subset
    t_base_full = t_base * total_rows / max(rows_done, 1)
    n_edges = sum(e.src.size for e in edges)
    return (name, total_rows, n_edges, t_ours, t_base_full, rows_done, same, total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=500, help="sessions of the synthetic LME-m-sized history")
    ap.add_argument("--baseline-rows", type=int, default=None,
                    help="run the slow baseline on at most this many rows per case and extrapolate its time")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--skip-locomo", action="store_true")
    args = ap.parse_args()

    from memgas.pipeline.association import associate_many

    associate_many([synthetic_history(30)], device=args.device)  # warm-up (imports, BLAS threads)
    cases = [("LME-m-sized synthetic (1 history)", [synthetic_history(args.sessions)])]
    if not args.skip_locomo:
        cases.append(("LoCoMo MiniLM (10 histories)", locomo_histories()))
    rows = [compare(n, h, args.device, args.baseline_rows) for n, h in cases]
    print(f"\nassociation benchmark (device={args.device}, mem_threshold=30, min_prior_nodes=20)")
    print(f"{'case':36} {'GMM rows':>8} {'edges':>7} {'ours s':>8} {'baseline s':>11} {'speedup':>8} {'identical':>14}")
    for name, r, ne, to, tb, done, same, total in rows:
        ext = "*" if done < r else " "
        print(f"{name:36} {r:8d} {ne:7d} {to:8.3f} {tb:10.2f}{ext} {tb / to:7.0f}x {same:6d}/{total:<6d} "
              f"({100 * same / max(total, 1):.2f}%)")
    if any(done < r for *_, done, _s, _t in [(x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]) for x in rows]):
        print("* baseline time extrapolated from a subset of rows (--baseline-rows)")


if __name__ == "__main__":
    main()
