"""GPU check: CUDA kernels vs the CPU path at LongMemEval-m scale; prints agreement and timings.

Parts (each skipped with a clear line when its package or a GPU is missing; nothing is installed):
  1. association candidate search (dense xp matmul + top-k) for --histories histories x 4*--sessions nodes
  2. batched GMM over all their candidate rows
  3. entropy router for --queries queries
  4. PPR for --queries queries on one history's association graph
  5. faiss candidate search (faiss GPU when importable with GPUs, else skipped)
The CPU reference runs on the first --cpu-histories histories (CPU at full scale would take minutes).

    bash benchmarks/gpu_check.sh                       # on the GPU machine, < 5 min
    python benchmarks/gpu_check.py --device cpu        # smoke test of the same code here (small sizes)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_association import synthetic_history  # noqa: E402

ROWS: list[tuple[str, str, str, str, str]] = []


def row(part: str, size: str, t_cpu: float | None, t_dev: float | None, agree: str) -> None:
    f = lambda t: "-" if t is None else f"{t:.3f}"  # noqa: E731
    ROWS.append((part, size, f(t_cpu), f(t_dev), agree))
    print(f"  done: {part}: {agree}", flush=True)


def sync(xp) -> None:
    if xp.__name__ == "cupy":
        xp.cuda.Stream.null.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu", "auto"])
    ap.add_argument("--histories", type=int, default=None, help="default 500 on cuda, 8 on cpu")
    ap.add_argument("--sessions", type=int, default=500, help="sessions per history (4 nodes each)")
    ap.add_argument("--cpu-histories", type=int, default=None, help="histories re-run on CPU (default 20 / all)")
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--skip-models", action="store_true", help="kernels only (no encoder / vLLM parts)")
    args = ap.parse_args()

    from memgas.kernels.backend import get_xp, to_host

    try:
        xp, dev = get_xp(args.device)
    except RuntimeError as e:
        print(f"SKIP all GPU parts: {e}")
        return
    n_hist = args.histories or (500 if dev == "cuda" else 8)
    n_cpu = min(n_hist, args.cpu_histories or (20 if dev == "cuda" else n_hist))
    print(f"gpu_check: device={dev}, {n_hist} histories x {4 * args.sessions} nodes, CPU reference on {n_cpu}")

    from memgas.kernels.gmm import fit_gmm_1d
    from memgas.kernels.ppr import build_csr, personalized_pagerank
    from memgas.kernels.router import entropy_router
    from memgas.pipeline import association as A

    hists = [synthetic_history(args.sessions, seed=i) for i in range(n_hist)]

    # 1. candidate search
    t0 = time.perf_counter()
    cands_dev = [A.candidates(h, device=dev, search="dense") for h in hists]
    sync(xp)
    t_dev = time.perf_counter() - t0
    t0 = time.perf_counter()
    cands_cpu = [A.candidates(h, device="cpu", search="dense") for h in hists[:n_cpu]]
    t_cpu = (time.perf_counter() - t0) * n_hist / n_cpu
    same = np.mean([(a.cand == b.cand).all(axis=1).mean() for a, b in zip(cands_dev, cands_cpu)])
    row("candidate search (dense)", f"{n_hist}x{4 * args.sessions}", t_cpu, t_dev,
        f"{100 * same:.3f}% identical candidate rows")
    rows_all = sum(c.rows.size for c in cands_dev)

    # 2. GMM over all rows
    sc = np.concatenate([c.scores for c in cands_dev])
    va = np.concatenate([c.valid for c in cands_dev])
    n_cpu_rows = sum(c.rows.size for c in cands_dev[:n_cpu])
    fit_gmm_1d(sc[:100], va[:100], device=dev)  # warm-up (CuPy kernel compilation)
    sync(xp)
    t0 = time.perf_counter()
    g_dev = fit_gmm_1d(sc, va, device=dev)
    sync(xp)
    t_dev = time.perf_counter() - t0
    t0 = time.perf_counter()
    g_cpu = fit_gmm_1d(sc[:n_cpu_rows], va[:n_cpu_rows], device="cpu")
    t_cpu = (time.perf_counter() - t0) * rows_all / n_cpu_rows
    acc_dev = to_host(g_dev.accepted)[:n_cpu_rows]
    same = (acc_dev == g_cpu.accepted).all(axis=1).mean()
    row("batched GMM", f"{rows_all} rows", t_cpu, t_dev, f"{100 * same:.3f}% identical accepted sets")

    # 3. router
    rng = np.random.default_rng(0)
    nodes = hists[0].reshape(-1, hists[0].shape[-1])
    q = nodes[rng.integers(0, nodes.shape[0], args.queries)] + 0.05 * rng.normal(size=(args.queries, nodes.shape[1]))
    q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)
    sims = (q @ nodes.T).astype(np.float64)
    stacked = np.stack([sims[:, g::4] for g in range(4)])
    entropy_router(stacked[:, :2], device=dev)
    sync(xp)
    t0 = time.perf_counter()
    w_dev, _ = entropy_router(stacked, device=dev)
    sync(xp)
    t_dev = time.perf_counter() - t0
    t0 = time.perf_counter()
    w_cpu, _ = entropy_router(stacked, device="cpu")
    t_cpu = time.perf_counter() - t0
    row("entropy router", f"{args.queries}x4x{args.sessions}", t_cpu, t_dev,
        f"max |dw| = {np.abs(to_host(w_dev) - w_cpu).max():.2e}")

    # 4. PPR on history 0's graph
    acc0 = to_host(g_dev.accepted)[: cands_dev[0].rows.size]
    ri, ci = np.nonzero(acc0)
    adj = build_csr(cands_dev[0].rows[ri], cands_dev[0].cand[ri, ci], nodes.shape[0])
    reset = np.maximum(sims * 0.25, 0) * (sims >= -np.sort(-sims, axis=1)[:, 14:15])
    for d in (0.1, 0.85):
        personalized_pagerank(adj, reset[:2], d, device=dev)
        sync(xp)
        t0 = time.perf_counter()
        p_dev = personalized_pagerank(adj, reset, d, device=dev)
        sync(xp)
        t_dev = time.perf_counter() - t0
        t0 = time.perf_counter()
        p_cpu = personalized_pagerank(adj, reset, d, device="cpu")
        t_cpu = time.perf_counter() - t0
        row(f"PPR damping={d}", f"{args.queries}q x {nodes.shape[0]}n, {adj.nnz // 2}e", t_cpu, t_dev,
            f"max |dx| = {np.abs(to_host(p_dev) - p_cpu).max():.2e}")

    # 5. faiss
    try:
        import faiss  # noqa: F401
    except ImportError:
        print("SKIP faiss candidate search: faiss not importable")
        faiss = None
    if faiss is not None:
        gpu_faiss = hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
        if dev == "cuda" and not gpu_faiss:
            print("SKIP faiss GPU candidate search: this faiss build has no GPU support (faiss-gpu-cu12)")
        else:
            big = np.concatenate(hists[: min(n_hist, 10)])  # one long history (e.g. 5000 sessions)
            E = A._as_nodes(big)
            rows = np.arange(20, E.shape[0])
            t0 = time.perf_counter()
            cf, vf = A._faiss_candidates(E, rows, 30, dev)
            t_dev = time.perf_counter() - t0
            t0 = time.perf_counter()
            cd, vd = A._dense_candidates(E, rows, 30, "cpu")
            t_cpu = time.perf_counter() - t0
            cf, _, _ = A._rescore(E, rows, cf, vf)
            cd, _, _ = A._rescore(E, rows, cd, vd)
            row(f"faiss candidates ({'GPU' if dev == 'cuda' else 'CPU'}) vs dense CPU", f"{E.shape[0]} nodes",
                t_cpu, t_dev, f"{100 * (cf == cd).all(axis=1).mean():.3f}% identical candidate rows")

    # 6. encoder: the Contriever recipe (HF AutoModel + mean pooling) in bf16 on CUDA vs float32 on CPU.
    #    Contriever itself cannot be downloaded offline; the MiniLM folder shipped in the wheel is a valid
    #    HF encoder dir, so it exercises the same code path.
    if not args.skip_models:
        encoder_check(dev)
        vllm_check(dev)

    print(f"\n{'part':38} {'size':>26} {'cpu s':>9} {dev + ' s':>9}  agreement")
    for r in ROWS:
        print(f"{r[0]:38} {r[1]:>26} {r[2]:>9} {r[3]:>9}  {r[4]}")
    print("(cpu s of candidate search / GMM extrapolated from the CPU-reference subset)")


def encoder_check(dev: str) -> None:
    try:
        from memgas.pipeline.models.encoders import HFMeanPoolingEncoder
    except ImportError as e:
        print(f"SKIP encoder: {e}")
        return
    texts = [f"[user]: session {i} about hiking, cooking and the {i % 7}th course on Coursera. " * (1 + i % 12)
             for i in range(2000)]
    cpu_enc = HFMeanPoolingEncoder("minilm", device="cpu", dtype="float32")
    t0 = time.perf_counter()
    ref = cpu_enc.encode(texts[:200])
    t_cpu = (time.perf_counter() - t0) * len(texts) / 200
    if dev != "cuda":
        row("encoder hf-mean (cpu only)", f"{len(texts)} texts", t_cpu, None, "cpu path ran")
        return
    enc = HFMeanPoolingEncoder("minilm", device="cuda", dtype="bfloat16", batch_size=256)
    enc.encode(texts[:64])  # warm-up
    t0 = time.perf_counter()
    out = enc.encode(texts)
    t_dev = time.perf_counter() - t0
    a, b = out[:200], ref
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    tokens = int(sum(enc.count_tokens(texts))) if hasattr(enc, "count_tokens") else 0
    row("encoder hf-mean bf16 (Contriever path)", f"{len(texts)} texts, {tokens} tok", t_cpu, t_dev,
        f"min cos vs fp32 CPU = {cos.min():.4f}; {tokens / t_dev:,.0f} tok/s")


def vllm_check(dev: str) -> None:
    """vLLM offline generation on summary prompts, only when vllm is importable and MEMGAS_VLLM_MODEL names a
    local model folder (nothing is downloaded)."""
    import os

    model = os.environ.get("MEMGAS_VLLM_MODEL")
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("SKIP vLLM: vllm not importable (carry it to run this part)")
        return
    if not model:
        print("SKIP vLLM: set MEMGAS_VLLM_MODEL to a local model folder")
        return
    from memgas.pipeline.models.base import SamplingParams
    from memgas.pipeline.models.llms import VLLMOfflineLLM
    from memgas.pipeline.prompts import get_prompt_set

    llm = VLLMOfflineLLM(model, context_tokens=8192)
    ps = get_prompt_set("paper-v1")
    prompts = [ps.summary(f"[user]: I finished {i % 5} courses on Coursera.\n[assistant]: Great!" * 20)
               for i in range(512)]
    t0 = time.perf_counter()
    res = llm.generate(prompts, SamplingParams(max_tokens=128))
    dt = time.perf_counter() - t0
    ok = sum(r.ok for r in res)
    toks = sum(r.completion_tokens for r in res)
    row("vLLM summaries (memgas backend)", f"{len(prompts)} prompts", None, dt,
        f"{ok}/{len(res)} ok, {toks / dt:,.0f} completion tok/s")


if __name__ == "__main__":
    main()
