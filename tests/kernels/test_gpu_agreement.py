"""CPU vs GPU agreement for router, top-k, association and rank_sessions (skipped without CuPy/CUDA).

cuBLAS and OpenBLAS round float32 products differently, so nothing computed from a float32 matmul can be
demanded bit-equal. Rankings are compared "identical up to ties" (``memgas.kernels.backend.same_up_to_ties``,
as benchmarks/bench_association.py does): at every rank both sides pick items whose reference (CPU) scores are equal
within the rounding error of the computation. Where no rounding differs (top-k of one array), ties are exact
(tol 0); float64 elementwise kernels (router) are compared to 1e-10.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from memgas.kernels.backend import get_xp, same_up_to_ties, scores_up_to_ties, to_host

pytestmark = pytest.mark.gpu
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "locomo_minilm_nodes.npz"
#: float32 dot products of unit vectors (d=384): cuBLAS vs OpenBLAS differ by ~1e-7; a 100x margin
F32_TOL = 1e-5


@pytest.fixture(autouse=True)
def _need_cuda() -> None:
    if get_xp("auto")[1] != "cuda":
        pytest.skip("CuPy/CUDA not available: GPU agreement tests skipped")


def _history() -> np.ndarray:
    f = np.load(FIXTURE, allow_pickle=False)
    return f["nodes"][f["conv_offsets"][0] : f["conv_offsets"][1]].astype(np.float32)


def test_router_topk_gpu() -> None:
    from memgas.kernels.router import entropy_router
    from memgas.kernels.topk import topk

    cp, _ = get_xp("cuda")
    rng = np.random.default_rng(0)
    sims = [rng.normal(0.3, 0.1, (50, 40)) for _ in range(4)]
    for rule in ("paper", "reference"):
        np.testing.assert_allclose(to_host(entropy_router(sims, temp=0.2, rule=rule, device="cuda")[0]),
                                   entropy_router(sims, temp=0.2, rule=rule)[0], rtol=1e-10)
    v = rng.integers(0, 5, (20, 64)).astype(np.float32)  # many exact ties
    i_gpu, v_gpu = topk(cp.asarray(v), 7)
    i_cpu, v_cpu = topk(v, 7)
    np.testing.assert_array_equal(to_host(v_gpu), v_cpu)  # same array in, no rounding: values are exact
    assert same_up_to_ties(i_gpu, i_cpu, v, tol=0.0).all()


def test_association_gpu() -> None:
    """Candidate lists agree up to float32 ties; rows whose candidate lists are identical get identical edges."""
    from memgas.pipeline.association import associate, candidates

    nodes = _history()
    ca, cb = candidates(nodes, search="dense"), candidates(nodes, device="cuda", search="dense")
    np.testing.assert_array_equal(ca.rows, cb.rows)
    ok = scores_up_to_ties(cb.scores, ca.scores, F32_TOL)
    assert ok.all(), f"{(~ok).sum()} candidate rows differ beyond float32 ties, e.g. row {ca.rows[~ok][:5]}"
    same_cands = {int(r) for r, a, b in zip(ca.rows, ca.cand, cb.cand) if (a == b).all()}

    a, b = associate(nodes), associate(nodes, device="cuda")

    def by_row(e):  # noqa: ANN001, ANN202
        out: dict[int, set[int]] = {}
        for s, d in zip(e.src.tolist(), e.dst.tolist()):
            out.setdefault(s, set()).add(d)
        return out

    ea, eb = by_row(a), by_row(b)
    bad = [r for r in set(ea) | set(eb) if ea.get(r, set()) != eb.get(r, set()) and r in same_cands]
    assert not bad, f"rows with identical candidates but different edges: {sorted(bad)[:10]}"


@pytest.mark.parametrize("method", ["memgas", "memgas-no-ppr", "session"])
def test_ranking_gpu(method: str) -> None:
    from memgas.pipeline.retrieve import rank_sessions

    f = np.load(FIXTURE, allow_pickle=False)
    nodes = _history()
    q = f["queries"][:50].astype(np.float32)
    g = [nodes[:, i] for i in range(4)]
    o_cpu, s_cpu = rank_sessions(*g, q, method=method, return_scores=True)
    o_gpu = rank_sessions(*g, q, method=method, device="cuda")
    tol = F32_TOL * np.abs(s_cpu).max(axis=1, keepdims=True)  # relative: PPR scores are ~1e-3
    ok = same_up_to_ties(o_gpu, o_cpu, s_cpu, tol=tol)
    assert ok.all(), f"{method}: {(~ok).sum()}/{ok.size} queries rank differently beyond ties"
