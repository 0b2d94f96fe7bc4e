"""Seeded clustered node vectors for benchmarks and tests of huge histories (no encoder needed).

Same structure as ``benchmarks/bench_association.synthetic_history`` (sessions drawn around topics, the
four granularities of a session around the session; unit vectors whose similarities land roughly where
MiniLM's do), but generated in fixed blocks of sessions, each from its own seed: any session range can be
generated alone and equals that range of a longer history, so a 10^6-session history is written block by
block to a ``.npy`` file (never whole in memory) and "appending" sessions means generating the next range.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from memgas.pipeline.schema import N_GRAN

#: sessions per generation block (each block has its own seed: ranges are independent of the length)
GEN_BLOCK = 4096


def _topics(n_topics: int, dim: int, seed: int) -> np.ndarray:
    t = np.random.default_rng([seed, 0]).normal(size=(n_topics, dim))
    return t / np.linalg.norm(t, axis=1, keepdims=True)


def clustered_nodes(s0: int, s1: int, *, dim: int = 384, n_topics: int = 1000, seed: int = 0) -> np.ndarray:
    """float32 [4*(s1-s0), d] unit vectors of sessions ``[s0, s1)`` of the seeded synthetic history."""
    topics = _topics(n_topics, dim, seed)
    out = []
    for b in range(s0 // GEN_BLOCK, -(-s1 // GEN_BLOCK)):
        rng = np.random.default_rng([seed, 1, b])
        t = rng.integers(0, n_topics, GEN_BLOCK)
        sess = topics[t] + 0.9 * rng.normal(size=(GEN_BLOCK, dim)) / np.sqrt(dim)
        nodes = sess[:, None, :] + 0.8 * rng.normal(size=(GEN_BLOCK, N_GRAN, dim)) / np.sqrt(dim)
        nodes /= np.linalg.norm(nodes, axis=-1, keepdims=True)
        lo, hi = max(s0, b * GEN_BLOCK) - b * GEN_BLOCK, min(s1, (b + 1) * GEN_BLOCK) - b * GEN_BLOCK
        out.append(nodes[lo:hi].reshape(-1, dim).astype(np.float32))
    return np.concatenate(out) if out else np.zeros((0, dim), np.float32)


def write_nodes(path: str | Path, n_sessions: int, **kw: int) -> Path:
    """Write sessions ``[0, n_sessions)`` to a ``.npy`` file block by block (memory: one block)."""
    path = Path(path)
    dim = int(kw.get("dim", 384))
    # plain writes, not a writable map: a map's dirty pages would count in the writer's RSS
    with open(path, "wb") as f:
        np.lib.format.write_array_header_2_0(
            f, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)), "fortran_order": False,
                "shape": (N_GRAN * n_sessions, dim)})
        for s in range(0, n_sessions, GEN_BLOCK):
            clustered_nodes(s, min(n_sessions, s + GEN_BLOCK), **kw).tofile(f)
    return path
