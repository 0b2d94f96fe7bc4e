"""Edges from candidates: the batched GMM accept (or the top-k ablation) and the edge lists it gives."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from memgas.kernels.backend import to_host
from memgas.kernels.gmm import fit_gmm_1d
from memgas.pipeline.association.nodes import Candidates

log = logging.getLogger(__name__)

#: rows per batched GMM fit (bounds its temporaries on huge histories; the result is the same)
GMM_ROWS = 1 << 16


@dataclass
class Edges:
    """Undirected edges of one history, stored once (src > dst)."""

    src: np.ndarray  # int64 [E]
    dst: np.ndarray  # int64 [E]
    sim: np.ndarray  # float32 [E]

    @staticmethod
    def empty() -> "Edges":
        return Edges(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))


def _accept(all_c: Sequence[Candidates], mode: str, topk_edges: int | None, device: str) -> list[np.ndarray]:
    """Accepted mask per history; all histories' rows go through one batched GMM fit."""
    if mode == "topk":
        if topk_edges is None:
            g = _accept(all_c, "gmm", None, device)
            n_rows = sum(a.shape[0] for a in g)
            topk_edges = max(1, int(round(sum(int(a.sum()) for a in g) / n_rows))) if n_rows else 1
            log.debug("association topk mode: topk_edges = mean GMM-accepted count = %d", topk_edges)
        return [c.valid & (np.arange(c.cand.shape[1])[None, :] < topk_edges) for c in all_c]
    if mode != "gmm":
        raise ValueError(f"mode must be 'gmm' or 'topk', got {mode!r}")
    K = max([c.cand.shape[1] for c in all_c] + [1])
    R = sum(c.rows.size for c in all_c)
    if R == 0:
        return [np.zeros(c.cand.shape, bool) for c in all_c]
    sc = np.zeros((R, K))
    va = np.zeros((R, K), bool)
    a = 0
    for c in all_c:
        r, kk = c.cand.shape
        sc[a : a + r, :kk] = c.scores
        va[a : a + r, :kk] = c.valid
        a += r
    # in row chunks: each row is fitted alone, so chunks change nothing but the memory held (the EM
    # temporaries are ~10 [rows, K] float64 arrays)
    acc = np.concatenate([to_host(fit_gmm_1d(sc[i : i + GMM_ROWS], va[i : i + GMM_ROWS], device=device).accepted)
                          for i in range(0, R, GMM_ROWS)])
    out, a = [], 0
    for c in all_c:
        r, kk = c.cand.shape
        out.append(acc[a : a + r, :kk])
        a += r
    return out


def _edges(c: Candidates, acc: np.ndarray) -> Edges:
    ri, ci = np.nonzero(acc)
    return Edges(c.rows[ri].astype(np.int64), c.cand[ri, ci].astype(np.int64), c.scores[ri, ci].astype(np.float32))


def edges_from(cands: Sequence[Candidates], mode: str, topk_edges: int | None, device: str) -> list[Edges]:
    """The edges of each candidate set (one batched GMM fit over all their rows, or the top-k ablation)."""
    return [_edges(c, a) for c, a in zip(cands, _accept(cands, mode, topk_edges, device))]


def concat_edges(parts: Sequence[Edges]) -> Edges:
    """Concatenate edge sets of the same history (e.g. incremental builds)."""
    if not parts:
        return Edges.empty()
    return Edges(np.concatenate([p.src for p in parts]), np.concatenate([p.dst for p in parts]),
                 np.concatenate([p.sim for p in parts]))
