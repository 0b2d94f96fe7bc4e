"""CPU vs GPU agreement for router, top-k, association and rank_sessions (skipped without CuPy/CUDA)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from memgas.kernels.backend import cuda_available, get_xp, to_host

pytestmark = pytest.mark.gpu
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "locomo_minilm_nodes.npz"


@pytest.fixture(autouse=True)
def _need_cuda() -> None:
    if not cuda_available():
        pytest.skip("CuPy/CUDA not available: GPU agreement tests skipped")


def test_router_topk_gpu() -> None:
    from memgas.kernels.router import entropy_router
    from memgas.kernels.topk import topk

    cp, _ = get_xp("cuda")
    rng = np.random.default_rng(0)
    sims = [rng.normal(0.3, 0.1, (50, 40)) for _ in range(4)]
    for rule in ("paper", "reference"):
        np.testing.assert_allclose(to_host(entropy_router(sims, rule=rule, device="cuda")[0]),
                                   entropy_router(sims, rule=rule)[0], rtol=1e-10)
    v = rng.integers(0, 5, (20, 64)).astype(np.float32)
    np.testing.assert_array_equal(to_host(topk(cp.asarray(v), 7)[0]), topk(v, 7)[0])


def test_association_and_ranking_gpu() -> None:
    from memgas.pipeline.association import associate
    from memgas.pipeline.retrieve import rank_sessions

    f = np.load(FIXTURE, allow_pickle=False)
    nodes = f["nodes"][f["conv_offsets"][0] : f["conv_offsets"][1]].astype(np.float32)
    q = f["queries"][:50].astype(np.float32)
    a, b = associate(nodes), associate(nodes, device="cuda")
    assert set(zip(a.src.tolist(), a.dst.tolist())) == set(zip(b.src.tolist(), b.dst.tolist()))
    g = [nodes[:, i] for i in range(4)]
    for m in ("memgas", "memgas-no-ppr", "session"):
        np.testing.assert_array_equal(rank_sessions(*g, q, method=m, device="cuda"), rank_sessions(*g, q, method=m))
