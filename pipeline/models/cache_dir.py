"""Where memgas keeps what it derives from model files (ONNX exports, de-quantised GGUF weights): one root."""

from __future__ import annotations

import os
from pathlib import Path


def memgas_cache_dir(sub: str) -> Path:
    """``$MEMGAS_CACHE_DIR/<sub>``, else ``$XDG_CACHE_HOME/memgas/<sub>``, else ``~/.cache/memgas/<sub>``.

    Everything under it is derived from model files and keyed by their digests: deleting it costs time only.
    """
    root = os.environ.get("MEMGAS_CACHE_DIR")
    if root:
        return Path(root).expanduser() / sub
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "memgas" / sub
