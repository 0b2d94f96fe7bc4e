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


#: Peak bytes of CuPy's default pool in this process since the last reset (None until tracking starts).
_POOL_PEAK: list[int] | None = None


def _track_pool_peak(cp: ModuleType) -> None:
    """Route CuPy's allocations through its default pool with a peak counter. The pool keeps freed blocks
    (``total_bytes`` only grows until ``free_all_blocks``), so its current size is neither the peak of one
    stage nor what the kernels held at once; ``used_bytes`` after each allocation is, and its maximum is the
    peak. Installed once per process, the first time a kernel asks for CUDA."""
    global _POOL_PEAK
    if _POOL_PEAK is not None:
        return
    pool = cp.get_default_memory_pool()
    peak = [int(pool.used_bytes())]

    def malloc(size: int) -> Any:
        mem = pool.malloc(size)
        used = pool.used_bytes()
        if used > peak[0]:
            peak[0] = used
        return mem

    cp.cuda.set_allocator(malloc)
    _POOL_PEAK = peak


def cupy_pool_peak_mb(reset: bool = True) -> float | None:
    """Peak MiB in use in CuPy's default pool since the last reset, in this process; None when no kernel of
    this process has run on CUDA (tracking starts with the first ``get_xp`` that returns CuPy)."""
    if _POOL_PEAK is None:
        return None
    out = _POOL_PEAK[0] / 2**20
    if reset:
        import cupy  # noqa: PLC0415

        _POOL_PEAK[0] = int(cupy.get_default_memory_pool().used_bytes())
    return out


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
    _track_pool_peak(cp)
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


def one_blas_thread() -> Any:
    """Kernels run with one BLAS thread wherever they run: a Ray task gets one CPU (and Ray sets
    OMP_NUM_THREADS=1), and multi-threaded BLAS sums in another order, so an in-process caller (the
    ``--no-ray`` path, ``rank_sessions``) would not give the bits of the job's tasks."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")
