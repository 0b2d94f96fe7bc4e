"""Batched 1-D two-component Gaussian mixture (scikit-learn ``GaussianMixture`` semantics).

Why hand-written: MemGAS fits one tiny GMM (<= 30 scores) per memory node; scikit-learn costs ~ms per fit
and cuML has no GaussianMixture (NVIDIA/cuml#2034), so we run EM for all rows at once as array ops
(NumPy on CPU, CuPy on GPU; the same ``xp`` code). scikit-learn is the correctness oracle in the tests.

Model reproduced (per row, over its valid scores x_1..x_n):
``GaussianMixture(n_components=2, covariance_type="full", tol=1e-3, reg_covar=1e-6, max_iter=100,
init_params="kmeans", random_state=0)``:

1. k-means init = ``KMeans(n_clusters=2, n_init=1, random_state=RandomState(0))``: k-means++ seeding
   (first centre = x[floor-ish(u0 * n)] via ``RandomState.choice`` with uniform p; then 2 local trials
   sampled proportionally to the squared distance with draws u1, u2, keeping the candidate with the lower
   potential), then Lloyd iterations (max 300, stop on identical labels or squared centre shift <= 1e-4 *
   var(x)). A fresh ``RandomState(0)`` gives every fit the same three uniform draws, so they are constants.
2. EM from the one-hot k-means responsibilities, stop when |lower-bound change| < tol.
3. ``predict`` = argmax of the weighted log-likelihood; accepted = members of the higher-mean component.

Degenerate rows (defined here; scikit-learn would either raise or fit an empty component):
fewer than 2 valid scores, or all valid scores equal -> nothing accepted, ``converged`` True,
``n_iter`` 0, both means = the row mean, variances = reg_covar, weights = [1, 0], ``degenerate`` True.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from memgas.kernels.backend import get_xp, to_device

log = logging.getLogger(__name__)

# The three uniform draws a fresh RandomState(0) hands to k-means++ for k=2: one for the first centre
# (RandomState.choice -> random_sample()), two for the local trials (uniform(size=2)).
_RS0 = np.random.RandomState(0)
_U_FIRST = float(_RS0.random_sample())
_U_TRIALS = tuple(float(v) for v in _RS0.uniform(size=2))
_EPS10 = 10 * np.finfo(np.float64).eps  # sklearn adds this to nk to avoid empty components
_LOG_2PI = float(np.log(2 * np.pi))


@dataclass
class GMMResult:
    """Per-row results of a batched fit (arrays live on the device they were computed on)."""

    accepted: Any  # bool [B, M]: valid members of the higher-mean component
    means: Any  # float64 [B, 2] (component order as in scikit-learn: k-means label order)
    variances: Any  # float64 [B, 2]
    weights: Any  # float64 [B, 2]
    converged: Any  # bool [B]
    n_iter: Any  # int64 [B]: EM iterations run (scikit-learn's n_iter_)
    degenerate: Any  # bool [B]: rows handled by the degenerate-row rule (see module docstring)


def _compact(xp: Any, scores: Any, mask: Any) -> tuple[Any, Any, Any]:
    """Move each row's valid entries to the front (stable), so prefix-cumsums match sklearn's arrays."""
    order = xp.argsort(~mask, axis=1, kind="stable") if xp is np else xp.argsort((~mask).astype(xp.int8), axis=1)
    x = xp.take_along_axis(scores, order, axis=1)
    n = mask.sum(axis=1)
    valid = xp.arange(scores.shape[1])[None, :] < n[:, None]
    return x, valid, order


def _kmeans_labels(xp: Any, x: Any, valid: Any, n: Any, max_iter: int = 300) -> Any:
    """Batched k-means++ (k=2, RandomState(0)) + Lloyd, returning labels in {0, 1} ([B, M], int64)."""
    B, M = x.shape
    nf = xp.maximum(n, 1).astype(xp.float64)
    rows = xp.arange(B)
    # sklearn's KMeans centres the data first; do the same so distances round the same way.
    mean = xp.where(valid, x, 0.0).sum(axis=1) / nf
    xc = xp.where(valid, x - mean[:, None], 0.0)
    var = xp.where(valid, (xc - (xc.sum(axis=1) / nf)[:, None]) ** 2, 0.0).sum(axis=1) / nf
    tol = var * 1e-4

    # first centre: RandomState.choice(n, p=1/n): cdf = cumsum(p)/cdf[-1]; searchsorted(cdf, u, 'right')
    p = xp.where(valid, 1.0 / nf[:, None], 0.0)
    cdf = xp.cumsum(p, axis=1)
    cdf = cdf / xp.take_along_axis(cdf, (xp.maximum(n, 1) - 1)[:, None], axis=1)
    first = xp.minimum((valid & (cdf <= _U_FIRST)).sum(axis=1), xp.maximum(n - 1, 0))
    c0 = xc[rows, first]
    # squared distances written in sklearn's operation order (-2xy + x^2 + y^2, clipped at 0) so that
    # near-ties (common: many duplicate similarity values) round the same way
    def sqd(c: Any) -> Any:
        return xp.maximum((-2.0 * c[:, None] * xc + (c * c)[:, None]) + xc * xc, 0.0)

    closest = xp.where(valid, sqd(c0), 0.0)
    pot = closest.sum(axis=1)
    csum = xp.cumsum(closest, axis=1)
    best_pot = None
    c1 = None
    for u in _U_TRIALS:  # two local trials; keep the first candidate with the strictly lowest potential
        cand = xp.minimum((valid & (csum < (u * pot)[:, None])).sum(axis=1), xp.maximum(n - 1, 0))
        xcand = xc[rows, cand]
        cpot = xp.where(valid, xp.minimum(closest, sqd(xcand)), 0.0).sum(axis=1)
        if best_pot is None:
            best_pot, c1 = cpot, xcand
        else:
            better = cpot < best_pot
            best_pot = xp.where(better, cpot, best_pot)
            c1 = xp.where(better, xcand, c1)

    centers = xp.stack([c0, c1], axis=1)  # [B, 2]
    labels_old = xp.full((B, M), -1, dtype=xp.int64)
    labels = labels_old
    active = xp.ones(B, dtype=bool)
    strict = xp.zeros(B, dtype=bool)
    for _ in range(max_iter):
        # Lloyd assignment as sklearn computes it: ||c||^2 - 2 x.c (the ||x||^2 term is dropped)
        d0 = centers[:, :1] * centers[:, :1] - 2.0 * xc * centers[:, :1]
        d1 = centers[:, 1:] * centers[:, 1:] - 2.0 * xc * centers[:, 1:]
        new_labels = (d1 < d0).astype(xp.int64)  # ties -> cluster 0, like argmin
        in1 = valid & (new_labels == 1)
        in0 = valid & (new_labels == 0)
        n1 = in1.sum(axis=1)
        n0 = in0.sum(axis=1)
        m0 = xp.where(in0, xc, 0.0).sum(axis=1) / xp.maximum(n0, 1)
        m1 = xp.where(in1, xc, 0.0).sum(axis=1) / xp.maximum(n1, 1)
        # Empty cluster (rare; only with duplicate centres): sklearn relocates the point farthest from its
        # centre into it. For k=2 in 1-D that is the point farthest from the other centre.
        far0 = xp.argmax(xp.where(valid, xp.abs(xc - centers[:, 1:]), -1.0), axis=1)
        far1 = xp.argmax(xp.where(valid, xp.abs(xc - centers[:, :1]), -1.0), axis=1)
        tot = xp.where(valid, xc, 0.0).sum(axis=1)
        e0 = n0 == 0
        e1 = n1 == 0
        m0 = xp.where(e0, xc[rows, far0], m0)
        m1 = xp.where(e0, (tot - xc[rows, far0]) / xp.maximum(n - 1, 1), m1)
        m1 = xp.where(e1, xc[rows, far1], m1)
        m0 = xp.where(e1, (tot - xc[rows, far1]) / xp.maximum(n - 1, 1), m0)
        new_centers = xp.stack([m0, m1], axis=1)
        shift = ((new_centers - centers) ** 2).sum(axis=1)
        same = xp.all((new_labels == labels_old) | ~valid, axis=1)
        labels = xp.where(active[:, None], new_labels, labels)
        centers = xp.where(active[:, None], new_centers, centers)
        strict = strict | (active & same)
        done = same | (shift <= tol)
        labels_old = labels
        active = active & ~done
        if not bool(active.any()):
            break
    # sklearn recomputes labels with the final centres when it did not converge strictly
    d0 = centers[:, :1] * centers[:, :1] - 2.0 * xc * centers[:, :1]
    d1 = centers[:, 1:] * centers[:, 1:] - 2.0 * xc * centers[:, 1:]
    final = (d1 < d0).astype(xp.int64)
    return xp.where(strict[:, None], labels, final)


def _estimate(xp: Any, x: Any, r: Any, reg_covar: float) -> tuple[Any, Any, Any]:
    """sklearn ``_estimate_gaussian_parameters`` for one component of 1-D data: (nk, mean, var), each [A]."""
    nk = r.sum(axis=1) + _EPS10  # r [A, M], zero on invalid entries; eps as sklearn (no empty component)
    mu = (r * x).sum(axis=1) / nk
    diff = x - mu[:, None]
    var = (r * diff * diff).sum(axis=1) / nk + reg_covar
    return nk, mu, var


def weighted_log_prob(xp: Any, x: Any, mu: Any, var: Any, w: Any) -> Any:
    """Weighted log-likelihood of one component [A, M], in sklearn's Cholesky-precision form."""
    pc = 1.0 / xp.sqrt(var)
    y = x * pc[:, None] - (mu * pc)[:, None]
    return -0.5 * (_LOG_2PI + y * y) + (xp.log(pc) + xp.log(w))[:, None]


def fit_gmm_1d(
    scores: Any,
    mask: Any | None = None,
    device: str = "cpu",
    *,
    tol: float = 1e-3,
    max_iter: int = 100,
    reg_covar: float = 1e-6,
) -> GMMResult:
    """Fit a 2-component 1-D GMM to every row of ``scores`` [B, M] at once (float64 internally).

    ``mask`` [B, M] bool marks valid entries (rows shorter than M); None = all valid. Returns a
    :class:`GMMResult` whose arrays live on ``device`` ("cpu" -> NumPy, "cuda" -> CuPy, "auto").
    No Python loop over rows: only over EM / Lloyd iterations.
    """
    xp, _ = get_xp(device)
    s = to_device(scores, xp).astype(xp.float64)
    if s.ndim != 2:
        raise ValueError(f"scores must be [B, M], got shape {tuple(s.shape)}")
    B, M = s.shape
    m = xp.ones((B, M), dtype=bool) if mask is None else to_device(mask, xp).astype(bool)
    if m.shape != s.shape:
        raise ValueError(f"mask shape {tuple(m.shape)} != scores shape {tuple(s.shape)}")
    if B == 0 or M == 0:
        z = xp.zeros((B, 2))
        return GMMResult(xp.zeros((B, M), bool), z, z + reg_covar, z, xp.ones(B, bool),
                         xp.zeros(B, xp.int64), xp.ones(B, bool))

    x, valid, order = _compact(xp, s, m)
    n = valid.sum(axis=1)
    big = xp.where(valid, x, -xp.inf).max(axis=1)
    small = xp.where(valid, x, xp.inf).min(axis=1)
    degenerate = (n < 2) | (big == small)
    # run degenerate rows on a harmless 2-point dummy so the batched maths stays finite
    dummy = xp.arange(M)[None, :] < 2
    valid = xp.where(degenerate[:, None], dummy, valid)
    x = xp.where(degenerate[:, None], xp.where(dummy, xp.arange(M)[None, :].astype(xp.float64), 0.0), x)
    x = xp.where(valid, x, 0.0)
    n = valid.sum(axis=1)
    nf = n.astype(xp.float64)

    labels = _kmeans_labels(xp, x, valid, n)
    r0 = ((labels == 0) & valid).astype(xp.float64)
    r1 = ((labels == 1) & valid).astype(xp.float64)
    nk0, mu0, v0 = _estimate(xp, x, r0, reg_covar)
    nk1, mu1, v1 = _estimate(xp, x, r1, reg_covar)
    w0, w1 = nk0 / nf, nk1 / nf

    lower = xp.full(B, -xp.inf)
    converged = xp.zeros(B, dtype=bool)
    n_iter = xp.zeros(B, dtype=xp.int64)
    # EM only on still-active rows: most rows converge in < 6 iterations, a few need ~40, so gathering
    # the active subset each iteration is several times cheaper than updating all rows.
    act = xp.arange(B)
    for _ in range(max_iter):
        xa, va, nfa = x[act], valid[act], nf[act]
        l0 = weighted_log_prob(xp, xa, mu0[act], v0[act], w0[act])
        l1 = weighted_log_prob(xp, xa, mu1[act], v1[act], w1[act])
        lpn = xp.logaddexp(l0, l1)
        new_lower = xp.where(va, lpn, 0.0).sum(axis=1) / nfa
        ra0 = xp.where(va, xp.exp(l0 - lpn), 0.0)
        ra1 = xp.where(va, xp.exp(l1 - lpn), 0.0)
        k0, m0_, s0_ = _estimate(xp, xa, ra0, reg_covar)
        k1, m1_, s1_ = _estimate(xp, xa, ra1, reg_covar)
        mu0[act], v0[act], w0[act] = m0_, s0_, k0 / (k0 + k1)
        mu1[act], v1[act], w1[act] = m1_, s1_, k1 / (k0 + k1)
        n_iter[act] += 1
        conv = xp.abs(new_lower - lower[act]) < tol
        lower[act] = new_lower
        converged[act[conv]] = True
        act = act[~conv]
        if act.size == 0:
            break

    l0 = weighted_log_prob(xp, x, mu0, v0, w0)
    l1 = weighted_log_prob(xp, x, mu1, v1, w1)
    label = (l1 > l0).astype(xp.int64)  # predict = argmax, ties -> component 0
    high = (mu1 > mu0).astype(xp.int64)  # argmax of the means, ties -> component 0
    acc_c = (label == high[:, None]) & valid & ~degenerate[:, None]
    inv = xp.argsort(order, axis=1)  # scatter back to the caller's column order (order is a permutation)
    accepted = xp.take_along_axis(acc_c, inv, axis=1)
    means = xp.stack([mu0, mu1], axis=1)
    var = xp.stack([v0, v1], axis=1)
    weights = xp.stack([w0, w1], axis=1)

    rowmean = xp.where(m, s, 0.0).sum(axis=1) / xp.maximum(m.sum(axis=1), 1)
    dg = degenerate[:, None]
    means = xp.where(dg, rowmean[:, None], means)
    var = xp.where(dg, reg_covar, var)
    weights = xp.where(dg, xp.asarray([1.0, 0.0])[None, :], weights)
    converged = converged | degenerate
    n_iter = xp.where(degenerate, 0, n_iter)
    if not bool(converged.all()):
        log.debug("GMM: %d of %d rows did not converge in %d iterations", int((~converged).sum()), B, max_iter)
    return GMMResult(accepted, means, var, weights, converged, n_iter, degenerate)
