"""Entropy router: per-query weights over granularities from the peakedness of their similarities.

For granularity g with similarities s_g [Q, N_g]: p = softmax(s_g / temp), H_g = -sum p log p.

- ``rule="paper"``: w_g = (1/H_g) / sum_g' (1/H_g')  (low entropy = confident = more weight).
- ``rule="reference"`` (the authors' released code): w_g = (1 - H_g) / sum_g' (1 - H_g'). With more than
  ~3 nodes H_g > 1, so the numerators turn negative and higher-entropy granularities get *more* weight:
  reproduced on purpose, it is what the published numbers ran.

Guards (documented behaviour):
- H_g = 0 (a granularity with one node, or a one-hot softmax): the paper rule uses max(H, 1e-12), so a
  zero-entropy granularity takes (almost) all the weight, and if every H is 0 the weights are equal.
- reference rule: if |sum (1 - H)| < 1e-12 the weights are equal (1/G).
- masked / empty granularities (mask all False for a row, or a list entry with no column): H = 0
  treatment does not apply; they get weight 0 (H reported 0) and the remaining weights are renormalised
  over the granularities that have nodes. memgas-cards' fifth granularity, the cards, is empty in a
  history whose sessions gave no card.

``normalise=True`` divides each H_g by log N_g (N_g: the granularity's nodes; log 2 for N_g < 2, where H_g is
0), the largest entropy a softmax over N_g nodes can have, so H_g is in [0, 1] whatever the granularity's size.
Why: the raw entropy grows with N_g, so under either rule a granularity with many more nodes than the others
(memgas-cards' cards: ~30 per session against one session node) reads as the least confident one even when its
softmax is as peaked, relative to its size, as theirs. Granularities of equal N_g (MemGAS's four: N_g = S)
share the divisor, so under the paper rule their weights are the raw ones (up to rounding).
"""
from __future__ import annotations

from typing import Any, Sequence

from memgas.kernels.backend import get_xp, to_device

_EPS = 1e-12


def _entropy(xp: Any, s: Any, mask: Any, temp: float) -> Any:
    if mask is None:
        return _entropy_all(xp, s, temp)
    z = xp.where(mask, s / temp, -xp.inf)
    zmax = z.max(axis=-1, keepdims=True)
    zmax = xp.where(xp.isfinite(zmax), zmax, 0.0)
    e = xp.where(mask, xp.exp(z - zmax), 0.0)
    tot = e.sum(axis=-1, keepdims=True)
    p = e / xp.where(tot == 0, 1.0, tot)
    logp = xp.where(mask & (p > 0), xp.log(xp.where(p > 0, p, 1.0)), 0.0)
    return -(p * logp).sum(axis=-1)


def _entropy_all(xp: Any, s: Any, temp: float) -> Any:
    """:func:`_entropy` where every node is real (no mask): the same operations on the same values, so the same
    bits (a ``where`` over an all-true mask is the identity, ``log 1 = 0`` stands for the masked-out zero), in
    place: a question's router over 4 x 10^6 nodes made a dozen temporaries of that size. ``s`` (a float64
    copy the caller made for this call) is overwritten."""
    z = xp.divide(s, temp, out=s)
    zmax = z.max(axis=-1, keepdims=True)
    zmax = xp.where(xp.isfinite(zmax), zmax, 0.0)
    xp.subtract(z, zmax, out=z)
    e = xp.exp(z, out=z)
    tot = e.sum(axis=-1, keepdims=True)
    p = xp.divide(e, xp.where(tot == 0, 1.0, tot), out=e)
    logp = xp.where(p > 0, p, 1.0)
    xp.log(logp, out=logp)
    return -(xp.multiply(p, logp, out=logp)).sum(axis=-1)


def entropy_router(
    sims: Sequence[Any] | Any,
    mask: Any | None = None,
    *,
    temp: float,
    rule: str,
    device: str = "cpu",
    normalise: bool = False,
) -> tuple[Any, Any]:
    """Router weights and the entropies the rule used (divided by log N_g under ``normalise``), both float64
    [Q, G].

    ``sims`` is either a list of G arrays [Q, N_g] (N_g may differ) or one array [G, Q, N] with an
    optional bool ``mask`` [G, Q, N] or [G, N] marking real nodes.
    """
    if rule not in ("paper", "reference"):
        raise ValueError(f"rule must be 'paper' or 'reference', got {rule!r}")
    xp, _ = get_xp(device)
    if isinstance(sims, (list, tuple)):
        ents, has, sizes = [], [], []
        for s in sims:
            a = to_device(s, xp).astype(xp.float64)  # a copy: _entropy_all overwrites it
            if a.shape[1] == 0:  # no node of this granularity (a history without cards): weight 0, below
                ents.append(xp.zeros(a.shape[0]))
                has.append(xp.zeros(a.shape[0], dtype=bool))
                sizes.append(xp.zeros(a.shape[0]))
                continue
            ents.append(_entropy(xp, a, None, temp))
            has.append(xp.full(a.shape[0], a.shape[1] > 0))
            sizes.append(xp.full(a.shape[0], float(a.shape[1])))
        H = xp.stack(ents, axis=1)
        present = xp.stack(has, axis=1)
        n_nodes = xp.stack(sizes, axis=1)
    else:
        a = to_device(sims, xp).astype(xp.float64)
        if mask is None:
            m = xp.ones(a.shape, dtype=bool)
        else:
            m = to_device(mask, xp).astype(bool)
            if m.ndim == 2:
                m = xp.broadcast_to(m[:, None, :], a.shape)
        H = _entropy(xp, a, m, temp).T  # [Q, G]
        present = m.any(axis=-1).T
        n_nodes = m.sum(axis=-1).T.astype(xp.float64)
    if normalise:
        H = H / xp.log(xp.maximum(n_nodes, 2.0))
    if rule == "paper":
        num = xp.where(present, 1.0 / xp.maximum(H, _EPS), 0.0)
    else:
        num = xp.where(present, 1.0 - H, 0.0)
    den = num.sum(axis=1, keepdims=True)
    n_present = xp.maximum(present.sum(axis=1, keepdims=True), 1)
    equal = xp.where(present, 1.0 / n_present, 0.0)
    bad = xp.abs(den) < _EPS
    w = xp.where(bad, equal, num / xp.where(bad, 1.0, den))
    return w, H
