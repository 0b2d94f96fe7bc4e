"""What the faiss-backed approximate causal searches (HNSW, IVF) share: the saved index and a thread limit."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class FaissCausalIndex:
    """Base of :class:`CausalHNSW` and :class:`CausalIVF`: ``self.index`` (a faiss index, or None before
    it is trained) and ``self.params`` (with ``threads``); subclasses take ``(d, params, *, index=)``."""

    index: Any
    params: Any

    def __init__(self, d: int, params: Any = None, *, index: Any = None) -> None:
        raise NotImplementedError

    def save(self, path: str | Path) -> None:
        """Write the index (vectors, graph or lists, and trained centroids) to ``path``."""
        import faiss  # noqa: PLC0415

        if self.index is None:
            raise ValueError("nothing to save: the index is not trained yet")
        faiss.write_index(self.index, str(path))

    @classmethod
    def load(cls, path: str | Path, params: Any = None) -> Any:
        """An index saved by :meth:`save`, to search the rows of appended sessions."""
        import faiss  # noqa: PLC0415

        index = faiss.read_index(str(path))
        return cls(index.d, params, index=index)

    def _threads(self) -> Any:
        """A context limiting faiss's OpenMP threads to ``params.threads`` (None: faiss's default)."""
        import faiss  # noqa: PLC0415

        n = self.params.threads
        if n is None:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def limit() -> Iterator[None]:
            old = faiss.omp_get_max_threads()
            faiss.omp_set_num_threads(n)
            try:
                yield
            finally:
                faiss.omp_set_num_threads(old)

        return limit()
