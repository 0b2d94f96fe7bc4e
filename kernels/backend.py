"""Array-module selection: one code path for NumPy (CPU) and CuPy (GPU).

Kernels are written against an ``xp`` module (NumPy or CuPy share the subset we use), so the GPU path is
the same code as the tested CPU path. ``get_xp`` picks the module for a device string.
"""
from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

DEVICES = ("cpu", "cuda", "auto")


def _cupy_or_none() -> ModuleType | None:
    try:
        import cupy  # noqa: PLC0415  (optional dependency)
    except Exception:  # ImportError, or a broken CUDA install raising on import
        return None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:
        return None
    return cupy


def cuda_available() -> bool:
    """True when CuPy imports and at least one CUDA device is visible."""
    return _cupy_or_none() is not None


def get_xp(device: str = "cpu") -> tuple[ModuleType, str]:
    """Return ``(array_module, device_name)`` for ``device`` in {"cpu", "cuda", "auto"}.

    "cpu" -> numpy; "cuda" -> cupy (RuntimeError when CuPy or a GPU is missing); "auto" -> cuda when
    available, else cpu.
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cpu":
        return np, "cpu"
    cp = _cupy_or_none()
    if cp is None:
        if device == "cuda":
            raise RuntimeError(
                "device='cuda' needs CuPy and a visible CUDA GPU (make setup-gpu: the gpu extra); "
                "use device='cpu' or 'auto'"
            )
        log.debug("device='auto': no CuPy/CUDA, using cpu")
        return np, "cpu"
    return cp, "cuda"


def xp_of(a: Any) -> ModuleType:
    """The array module an array belongs to (numpy for anything that is not a CuPy array)."""
    mod = type(a).__module__
    if mod.startswith("cupy"):
        import cupy  # noqa: PLC0415

        return cupy
    return np


def to_host(a: Any) -> Any:
    """Copy a CuPy array to a NumPy array; NumPy arrays (and anything else) pass through."""
    if type(a).__module__.startswith("cupy"):
        return a.get()
    return a


def to_device(a: Any, xp: ModuleType) -> Any:
    """Put a host (or device) array on ``xp``'s device."""
    if xp is np:
        return np.asarray(to_host(a))
    return xp.asarray(a)


# -- CPU/GPU agreement -------------------------------------------------------------------------------------


def same_up_to_ties(order: Any, ref_order: Any, ref_scores: Any, tol: float = 0.0, k: int | None = None) -> np.ndarray:
    """Per row, bool: the ranking ``order`` equals ``ref_order`` up to ties.

    ``order``/``ref_order``: int [Q, K] indices into the last axis of ``ref_scores`` [Q, N], best first (only the
    first ``k`` ranks are compared when given). A row agrees when at every rank both pick items whose
    *reference* scores are equal within ``tol``, i.e. the rankings differ only by reordering tied items.
    ``tol=0`` means exact ties. When the two rankings come from differently rounded arithmetic (cuBLAS vs
    OpenBLAS, a float32 matmul: ~1e-6 on unit vectors), pass that rounding error as ``tol``; ties are then
    judged on the reference's scores, so a real difference in ranking is still caught. ``tol`` may also be a
    per-row array [Q, 1] (e.g. relative to each row's largest score).
    """
    o, r, s = (np.asarray(to_host(a)) for a in (order, ref_order, ref_scores))
    if k is not None:
        o, r = o[..., :k], r[..., :k]
    if o.shape != r.shape:
        raise ValueError(f"rankings differ in shape: {o.shape} vs {r.shape}")
    return scores_up_to_ties(np.take_along_axis(s, o, -1), np.take_along_axis(s, r, -1), tol) | (o == r).all(-1)


def scores_up_to_ties(scores: Any, ref_scores: Any, tol: float = 0.0) -> np.ndarray:
    """Per row, bool: two rank-ordered score lists (the reference scores of what each side picked, best first)
    are equal within ``tol`` at every rank; the companion of :func:`same_up_to_ties` when the scores were
    gathered already (e.g. candidate lists rescored in float64)."""
    a, b = np.asarray(to_host(scores)), np.asarray(to_host(ref_scores))
    if a.shape != b.shape:
        raise ValueError(f"score lists differ in shape: {a.shape} vs {b.shape}")
    with np.errstate(invalid="ignore"):  # inf - inf: equal infinities (masked entries) are ties via ==
        same = (a == b) | (np.abs(a - b) <= tol)
    return same.all(-1) if same.ndim else np.asarray(bool(same))
