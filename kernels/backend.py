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
                "device='cuda' needs CuPy and a visible CUDA GPU (pip install 'memgas[gpu]'); "
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
