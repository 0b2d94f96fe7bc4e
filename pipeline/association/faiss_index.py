"""What the faiss-backed approximate causal searches (HNSW, IVF) share: the saved index and a thread limit;
and a faiss IVF index as bytes (no pickle) and back, read and written through callbacks."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np


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


def empty_ivf_like(index: Any) -> Any:
    """A faiss IVF index with ``index``'s trained centroids and quantiser and no entries (copying
    ``index`` whole would copy its lists: the history's nodes)."""
    import faiss

    quantizer = faiss.IndexFlatIP(index.d)
    quantizer.add(index.quantizer.reconstruct_n(0, index.quantizer.ntotal))
    if isinstance(index, faiss.IndexIVFScalarQuantizer):
        out = faiss.IndexIVFScalarQuantizer(quantizer, index.d, index.nlist, index.sq.qtype, index.metric_type,
                                            index.by_residual)
        out.sq.trained = index.sq.trained
    elif isinstance(index, faiss.IndexIVFFlat):
        out = faiss.IndexIVFFlat(quantizer, index.d, index.nlist, index.metric_type)
    else:
        raise TypeError(f"no IVF delta of a {type(index).__name__}")
    out.is_trained = True
    out.own_fields = True
    quantizer.this.disown()
    return out


def raw_bytes(raw: Any) -> np.ndarray:
    """A faiss index (centroids, quantiser, lists) as uint8 bytes: ``faiss.serialize_index``'s bytes (no
    pickle), written through a callback into one growing ``bytearray`` (the returned array is a view of it).
    ``serialize_index`` fills a ``std::vector`` and returns a NumPy copy of it: twice the index beside the
    index while the last unit of a long history saves it."""
    import faiss

    out = bytearray()

    def write(chunk: bytes) -> int:
        out.extend(chunk)
        return len(chunk)

    writer = faiss.PyCallbackIOWriter(write)
    faiss.write_index(raw, writer)
    del writer
    return np.frombuffer(out, np.uint8)


def raw_from_bytes(data: Any, *, d: int, ntotal: int) -> Any:
    """A faiss IVF index stored by :func:`raw_bytes`, checked against what its row says it holds (dimension,
    nodes): bytes that deserialise to another index raise instead of being searched. ``data`` (bytes, an
    array, a read-only view into Ray's object store) is read in place, a chunk at a time, through a
    callback (``deserialize_index`` would copy it whole into a ``std::vector`` first). A list or tuple of
    such buffers is read as their concatenation, in order (an index saved in chunks, read without first
    copying them into one buffer)."""
    import faiss

    chunks = [np.frombuffer(c, np.uint8) for c in (data if isinstance(data, (list, tuple)) else [data])]
    at = [0, 0]  # chunk, offset in it

    def read(n: int) -> bytes:
        parts = []
        while n > 0 and at[0] < len(chunks):
            piece = chunks[at[0]][at[1] : at[1] + n]
            parts.append(piece.tobytes())
            n -= piece.size
            at[1] += piece.size
            if at[1] >= chunks[at[0]].size:
                at[0], at[1] = at[0] + 1, 0
        return parts[0] if len(parts) == 1 else b"".join(parts)

    reader = faiss.PyCallbackIOReader(read)
    owner = faiss.read_index(reader)
    del reader
    return _checked_ivf(owner, d=d, ntotal=ntotal)


def raw_from_file(path: str | Path, *, d: int, ntotal: int) -> Any:
    """A faiss IVF index file (``faiss.write_index``'s format, the bytes :func:`raw_bytes` gives) *mapped*,
    not read: its lists are views of the file's pages (``IO_FLAG_MMAP_IFC``), so opening it costs the
    header and the centroids, and a search reads only the lists it probes (from the page cache once read).
    Checked like :func:`raw_from_bytes`. Read-only: an add to its lists aborts the process (faiss asserts
    that a viewed vector is never resized), so it is searched through :func:`stacked_ivf`, which adds
    elsewhere."""
    import faiss

    return _checked_ivf(faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC), d=d, ntotal=ntotal)


def _checked_ivf(owner: Any, *, d: int, ntotal: int) -> Any:
    """``owner`` (what ``faiss.read_index`` returned) downcast, checked to be an IVF index of ``ntotal``
    nodes of dimension ``d``: bytes that deserialise to another index raise instead of being searched."""
    import faiss

    raw = faiss.downcast_index(owner)
    owner.this.disown()  # the downcast wrapper owns the C++ index from here on (else it is freed with ``owner``)
    raw.this.acquire()
    if not isinstance(raw, faiss.IndexIVF) or raw.d != d or raw.ntotal != ntotal:
        raise ValueError(f"stored index is a {type(raw).__name__} of {raw.ntotal} nodes of dimension {raw.d}, "
                         f"expected an IVF index of {ntotal} of {d}")
    return raw


def stacked_ivf(base: Any, rest: Any) -> tuple[Any, tuple]:
    """An IVF index whose list ``i`` is ``base``'s list ``i`` followed by ``rest``'s (faiss
    ``HStackInvertedLists``): the entries, in the order, of ``base`` after ``rest`` was merged into it
    (``merge_from``, which appends each list's entries), so a search returns the same ids and scores bit for
    bit (the lists are scanned in the same order: the tests compare) without copying ``base`` (a mapped
    file, :func:`raw_from_file`). Its lists are read-only: add to ``rest`` (with node ids) and raise the
    returned index's ``ntotal`` by as many. Returns the index and what it points into, to be kept alive
    with it (it owns neither ``base`` nor ``rest``)."""
    import faiss

    if rest.nlist != base.nlist or rest.code_size != base.code_size:
        raise ValueError(f"IVF lists of {rest.nlist} lists cannot follow an index of {base.nlist}")
    shell = empty_ivf_like(base)
    members = faiss.InvertedListsPtrVector()
    members.push_back(base.invlists)
    members.push_back(rest.invlists)
    lists = faiss.HStackInvertedLists(members.size(), members.data())
    shell.replace_invlists(lists, False)  # frees the shell's own empty lists; ``lists`` stays Python's
    shell.ntotal = base.ntotal + rest.ntotal
    return shell, (base, rest, lists, members)
