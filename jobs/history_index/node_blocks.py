"""The driver's side of node vectors in row blocks (:mod:`memgas.pipeline.association.blocks`).

A history longer than one block is read from the bank a block of whole sessions at a time
(:mod:`memgas.jobs.history_index.block_reader`; complete blocks as stored,
:mod:`memgas.jobs.history_index.stored_blocks`), never whole. Each block is read once per stage run and then
handed over: shared through the executor (:func:`memgas.jobs.executor.share`, Ray's object store) when the
units run as Ray tasks (the task fetches it when it reads those rows, :func:`memgas.jobs.executor.fetch`;
the driver keeps only the opaque reference), or spilled to a
``.npy`` file in a temporary directory when the stage runs in-process (read back row by row, ``pread``,
as :class:`~memgas.pipeline.association.nodes.NodeFile`). The driver's memory for node vectors is then one
block (plus the reader's Arrow buffers), whatever the history's length.

A spill directory is deleted with its :class:`HistoryBlocks` (or at the interpreter's exit), but a process
killed by SIGKILL (the OOM killer, a user's ``kill -9``) cannot delete it: at 10^6 sessions it holds ~6 GB.
Its files are reopened by path (by :class:`NodeFile`), so they cannot be unlinked while open as the vector
spill is. Each directory is named after the host and the process that made it instead, and the next one
made on the host deletes those whose process is gone (:func:`spill_directory`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from memgas.jobs import executor
from memgas.jobs.history_index import prefixes
from memgas.jobs.history_index.block_reader import HistoryBlockReader
from memgas.jobs.history_index.stored_blocks import TABLE, StoredBlocks
from memgas.jobs.keys import encoder_keys
from memgas.jobs.stage import StageContext
from memgas.pipeline.association import blocks
from memgas.pipeline.association.blocks import NodeBlocks, SparseBlock
from memgas.pipeline.association.nodes import NodeFile
from memgas.pipeline.errors import BankError
from memgas.pipeline.process_dirs import process_directory, sweep_dead
from memgas.pipeline.schema import N_GRAN

SPILL_PREFIX = "memgas-blocks-"


class HistoryBlocks:
    """The blocks of one history read so far in this stage run, as handles: ``ObjectRef``s (Ray) or
    spilled files (in-process, deleted with this object)."""

    def __init__(self, ctx: StageContext, history: str, block_rows: int, use_ray: bool | None = None) -> None:
        """``use_ray``: hand the blocks over through the executor (Ray's object store; default: as the stage
        runs, ``ctx.use_ray``); ``False`` spills them to files, for a reader in this process. Complete blocks
        are read from the bank's stored blocks where they are there, and stored when they were gathered
        (:mod:`memgas.jobs.history_index.stored_blocks`)."""
        self.bank, self.keys, self.history = ctx.bank, encoder_keys(ctx), history
        self.stored = self._stored_blocks(ctx, history, block_rows)
        self.reader: HistoryBlockReader | None = None  # made at the first block that is not stored
        self.block_rows = block_rows
        self.use_ray = ctx.use_ray if use_ray is None else use_ray
        self.handles: list[Any] = []
        self.dim = 0
        self._spill = None if self.use_ray else spill_directory()

    def _stored_blocks(self, ctx: StageContext, history: str, block_rows: int) -> StoredBlocks | None:
        """The history's stored blocks (None: it has no nodes). Another graph's blocks (memgas-cards',
        :class:`~memgas.jobs.history_index.card_blocks.CardGraphBlocks`) are stored under its own prefix
        digests and layout: it gives its own."""
        chain = prefixes.chains(ctx).get(history)
        return StoredBlocks(ctx.bank, self.keys, history, block_rows, chain) if chain else None

    def nodes(self, n_rows: int) -> NodeBlocks:
        """The first ``n_rows`` node vectors, reading the blocks not read yet."""
        while len(self.handles) * self.block_rows < n_rows:
            m = self._block(len(self.handles))
            self.dim = m.shape[1]
            self.handles.append(self._hand_over(m, len(self.handles)))
            del m  # one block on the driver at a time
        return NodeBlocks(self.handles, self.block_rows, n_rows, self.dim, keep=self, fetch=self._fetch)

    @property
    def _fetch(self) -> Any:
        """How a task reads a handle: the executor's fetch for shared ones (None: handles are read in place)."""
        return executor.fetch if self.use_ray else None

    def _hand_over(self, m: np.ndarray | SparseBlock, i: int) -> Any:
        """Block ``i``'s handle: shared through the executor (Ray's object store), or (in-process) spilled to a
        file; a :class:`SparseBlock` (a few rows) is kept as it is in-process."""
        if self.use_ray:
            return executor.share(m)
        if isinstance(m, SparseBlock):
            return m
        path = Path(self._spill.name) / f"{i}.npy"
        np.save(path, m)
        return NodeFile(path)

    def all_stored(self, below: int) -> bool:
        """Whether the blocks ``[0, below)`` are stored (by their names: their bytes are verified when read)."""
        s = self.stored
        return s is not None and all(s.complete(i) and self.bank.has_part(TABLE, s.part(i)) for i in range(below))

    def read_blocks(self, first: int, n_rows: int) -> dict[int, np.ndarray]:
        """The blocks from ``first`` to the one holding row ``n_rows - 1``, as arrays (stored, else gathered
        from block ``first``'s sessions on), not handed over. Call it before any other read of this object."""
        return {i: self._block(i) for i in range(first, -(-n_rows // self.block_rows))}

    def sparse_nodes(self, n_rows: int, tail: dict[int, np.ndarray], rows: np.ndarray,
                     taken: dict[int, SparseBlock] | None = None) -> NodeBlocks | None:
        """The first ``n_rows`` node vectors as a task that reads only ``rows`` (sorted node ids) before the
        blocks of ``tail`` (:meth:`read_blocks`) needs them: the blocks before as :class:`SparseBlock` of
        those rows (read from the stored blocks, one at a time; ``taken``: those :meth:`streamed` took
        already), or no handle where none is needed; the tail whole. None when a block needed is not stored
        intact (the caller then ships every block)."""
        B, first = self.block_rows, min(tail)
        handles: list[Any] = []
        cuts = np.searchsorted(rows, np.arange(first + 1) * B)
        for i in range(first):
            local = rows[cuts[i] : cuts[i + 1]] - i * B
            if local.size == 0:
                handles.append(None)
                continue
            if taken is not None and i in taken:
                handles.append(self._hand_over(taken[i], i))
                continue
            m = self.stored.get(i) if self.stored is not None else None
            if m is None:
                return None
            handles.append(self._hand_over(SparseBlock(local, m[local], B), i))
            del m
        for i in sorted(tail):
            handles.append(self._hand_over(tail[i], i))
        dim = tail[first].shape[1]
        return NodeBlocks(handles, B, n_rows, dim, keep=self, fetch=self._fetch)

    def streamed(self, n_rows: int, tail: dict[int, np.ndarray], rows: np.ndarray
                 ) -> tuple[NodeBlocks, dict[int, SparseBlock]]:
        """The first ``n_rows`` node vectors for a reader here, on the driver (an append's exact search of its
        recall sample): the stored blocks before ``tail`` read when read (one at a time), the tail as given.
        Each stored block read gives up its ``rows`` (sorted node ids) on the way, into the returned dict,
        for :meth:`sparse_nodes`: a block is read once for both. A block not stored raises
        :class:`~memgas.pipeline.errors.BankError`."""
        B, first = self.block_rows, min(tail)
        taken: dict[int, SparseBlock] = {}

        def fetch(h: Any) -> Any:
            if not isinstance(h, int):
                return h
            m = self.stored.get(h) if self.stored is not None else None
            if m is None:
                raise BankError(f"{self.bank.path}: node block {h} of history {self.history} is not stored intact")
            a, b = np.searchsorted(rows, [h * B, (h + 1) * B])
            taken[h] = SparseBlock(rows[a:b] - h * B, m[rows[a:b] - h * B], B)
            return m

        handles = [*range(first), *(tail[i] for i in sorted(tail))]
        return NodeBlocks(handles, B, n_rows, tail[first].shape[1], fetch=fetch), taken

    def _block(self, i: int) -> np.ndarray:
        """Block ``i``: stored, else gathered (and then stored: complete, or as far as the history goes). A
        stored partial block that this history begins with gives its first rows, and only the sessions
        after it are gathered (an append's), or the whole block when the history ends there."""
        m = self.stored.get(i) if self.stored is not None else None
        if m is not None:
            return m
        bs = self.block_rows // N_GRAN
        have = self.stored.partial(i) if self.stored is not None else None
        start, head = (i * bs, None) if have is None else have
        del have
        if head is not None and start == min(self.stored.sessions, (i + 1) * bs):
            return head
        if self.reader is None:  # the sessions before ``start`` are stored: gather from there on
            self.reader = HistoryBlockReader(self.bank, self.keys, self.history, self.block_rows, from_session=start)
        if head is None:
            m = self.reader.read(i)
        else:  # each session's rows are its own: the stored ones, then those gathered after them
            m = np.concatenate([head, self.reader.read_sessions(start, min(self.reader.n_sessions, (i + 1) * bs))])
            del head  # one block held (with its copy while it is written), as without a stored part
        if self.stored is not None:
            self.stored.put(i, m)
        return m


def sweep_dead_spills(root: str | None = None) -> list[str]:
    """Delete the spill directories under ``root`` (default: the temporary directory) that this host's
    processes made and that outlived them (killed): :func:`memgas.pipeline.process_dirs.sweep_dead`."""
    return sweep_dead(SPILL_PREFIX, root)


def spill_directory(root: str | None = None) -> tempfile.TemporaryDirectory:
    """A new spill directory named after this host and process, after sweeping those of dead processes."""
    return process_directory(SPILL_PREFIX, root)


def keep_blocks(ctx: StageContext, histories: set[str]) -> None:
    """Forget the blocks of histories other than ``histories`` (a unit's): a long history's units come one
    after another in the plan, so another history's blocks are not needed again. A payload that still
    holds them keeps them (Ray counts the task's references; a spill directory lives as long as its
    ``NodeBlocks``)."""
    cache = ctx.scratch.setdefault("node_blocks", {})
    for h in [h for h in cache if h not in histories]:
        del cache[h]


def history_nodes(ctx: StageContext, history: str, n_rows: int) -> NodeBlocks:
    """The first ``n_rows`` node vectors of ``history`` in blocks of ``blocks.BLOCK_ROWS`` rows. The blocks
    are kept (in ``ctx.scratch``) for the next unit of the same history, which needs the prefix of this one
    and more."""
    cache = ctx.scratch.setdefault("node_blocks", {})
    if history not in cache:
        cache[history] = HistoryBlocks(ctx, history, blocks.BLOCK_ROWS)
    return cache[history].nodes(n_rows)
