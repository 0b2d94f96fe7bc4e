"""The driver's side of node vectors in row blocks (:mod:`memgas.pipeline.association.blocks`).

A history longer than one block is read from the bank a block of whole sessions at a time (its nodes rows
by position range, then the pairs and embeddings of those texts only), never whole. Each block is read
once per stage run and then handed over: ``ray.put`` into the object store when the units run as Ray tasks
(the task ``ray.get``s it when it reads those rows; the driver keeps only the reference), or spilled to a
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

import logging
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs.keys import encoder_keys
from memgas.jobs.stage import StageContext
from memgas.jobs.stages.shards import node_matrix
from memgas.pipeline.association import blocks
from memgas.pipeline.association.blocks import NodeBlocks
from memgas.pipeline.association.nodes import NodeFile
from memgas.pipeline.bank import Bank
from memgas.pipeline.errors import BankError
from memgas.pipeline.schema import N_GRAN

if TYPE_CHECKING:
    from memgas.pipeline.spilled_vectors import SpilledVectors

log = logging.getLogger(__name__)

SPILL_PREFIX = "memgas-blocks-"


#: rows per batch of the block reader's table reads (12 MiB of embeddings at d = 384): a block's rows are
#: picked out of the tables batch by batch, never a whole row group (``Bank.read(batch_rows=...)``)
READ_BATCH_ROWS = 8192


class HistoryBlockReader:
    """Node vectors of one history, block ``i`` = sessions ``[i*bs, (i+1)*bs)`` (``bs = block_rows / 4``) in
    position order, read from the bank under the encoder keys ``keys`` (:func:`encoder_keys`)."""

    def __init__(self, bank: Bank, keys: dict[str, str], history: str, block_rows: int) -> None:
        self.bank, self.keys, self.history = bank, keys, history
        self.block_sessions = block_rows // N_GRAN
        # the history's session positions: one int column (the texts are read per block)
        t = bank.read("nodes", ["history_id", "granularity", "position"], dedupe=False, batch_rows=READ_BATCH_ROWS,
                      filter=(pc.field("history_id") == history) & (pc.field("granularity") == "session"))
        self.positions = np.unique(t["position"].to_numpy())
        self._vectors: SpilledVectors | None = None

    def _gathered(self) -> SpilledVectors:
        """Every vector of the history, gathered in one pass over ``embeddings`` on the first block read
        (:mod:`memgas.pipeline.spilled_vectors`): reading them block by block scanned the whole table once per
        block. Spilled to a temporary file that lives as long as this reader."""
        if self._vectors is None:
            from memgas.pipeline.spilled_vectors import SpilledVectors

            nodes = self.bank.read("nodes", ["granularity", "text_hash"], batch_rows=READ_BATCH_ROWS,
                                   filter=pc.field("history_id") == self.history)
            gran = nodes["granularity"]
            sessions = nodes.filter(pc.equal(gran, "session"))["text_hash"]
            pairs = self.bank.read("pairs", ["session_hash", "text_hash"], batch_rows=READ_BATCH_ROWS,
                                   filter=pc.field("session_hash").isin(pc.unique(sessions)))
            by_role = {"main": nodes.filter(pc.invert(pc.is_in(gran, pa.array(["session", "turn"]))))["text_hash"],
                       "session": sessions, "pair": pairs["text_hash"]}
            need: dict[str, list] = {}
            for role, hashes in by_role.items():  # one list per encoder key (roles may share one)
                need.setdefault(self.keys[role], []).extend(hashes.chunks)
            self._vectors = SpilledVectors(self.bank, {k: pa.chunked_array(c, pa.string()) for k, c in need.items()})
        return self._vectors

    @property
    def n_sessions(self) -> int:
        return int(self.positions.size)

    def read(self, i: int) -> np.ndarray:
        """float32 ``[4*(s1-s0), d]``: the rows of block ``i``, those of the whole history's matrix."""
        from memgas.pipeline.granularity import MatrixLoader

        s0, s1 = i * self.block_sessions, min(self.n_sessions, (i + 1) * self.block_sessions)
        if not 0 <= s0 < s1:
            raise BankError(f"{self.bank.path}: history {self.history!r} has no node block {i} "
                            f"({self.n_sessions} sessions)")
        lo, hi = int(self.positions[s0]), int(self.positions[s1 - 1])
        nodes = self.bank.read("nodes", batch_rows=READ_BATCH_ROWS, filter=(pc.field("history_id") == self.history)
                               & (pc.field("position") >= lo) & (pc.field("position") <= hi))
        loader = MatrixLoader(self.bank, self.keys["main"], nodes=nodes, pair_encoder=self.keys["pair"],
                              session_encoder=self.keys["session"], batch_rows=READ_BATCH_ROWS,
                              vectors=self._gathered())
        m = node_matrix(loader.get(self.history))
        if m.shape[0] != N_GRAN * (s1 - s0):
            raise BankError(f"{self.bank.path}: history {self.history!r}: block {i} has {m.shape[0]} nodes, "
                            f"expected {N_GRAN * (s1 - s0)}")
        return m


class HistoryBlocks:
    """The blocks of one history read so far in this stage run, as handles: ``ObjectRef``s (Ray) or
    spilled files (in-process, deleted with this object)."""

    def __init__(self, ctx: StageContext, history: str, block_rows: int, use_ray: bool | None = None) -> None:
        """``use_ray``: hand the blocks over through Ray's object store (default: as the stage runs,
        ``ctx.use_ray``); ``False`` spills them to files, for a reader in this process."""
        self.reader = HistoryBlockReader(ctx.bank, encoder_keys(ctx), history, block_rows)
        self.block_rows = block_rows
        self.use_ray = ctx.use_ray if use_ray is None else use_ray
        self.handles: list[Any] = []
        self.dim = 0
        self._spill = None if self.use_ray else spill_directory()

    def nodes(self, n_rows: int) -> NodeBlocks:
        """The first ``n_rows`` node vectors, reading the blocks not read yet."""
        while len(self.handles) * self.block_rows < n_rows:
            m = self.reader.read(len(self.handles))
            self.dim = m.shape[1]
            if self.use_ray:
                import ray

                self.handles.append(ray.put(m))
            else:
                path = Path(self._spill.name) / f"{len(self.handles)}.npy"
                np.save(path, m)
                self.handles.append(NodeFile(path))
            del m  # one block on the driver at a time
        return NodeBlocks(self.handles, self.block_rows, n_rows, self.dim, keep=self)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_dead_spills(root: str | None = None) -> list[str]:
    """Delete the spill directories under ``root`` (default: the temporary directory) that this host's
    processes made and that outlived them (killed). A directory of a live process, of another host (a
    shared ``/tmp``) or of another name is left alone. Returns the paths deleted."""
    root = root or tempfile.gettempdir()
    pattern = re.compile(rf"{re.escape(SPILL_PREFIX)}(?P<host>.+)-(?P<pid>\d+)-[^-]+")
    host, gone = socket.gethostname(), []
    for name in os.listdir(root):
        m = pattern.fullmatch(name)
        if m is None or m["host"] != host or _alive(int(m["pid"])):
            continue
        path = os.path.join(root, name)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            gone.append(path)
    if gone:
        log.info("deleted %d spill directories of killed processes: %s", len(gone), ", ".join(gone))
    return gone


def spill_directory(root: str | None = None) -> tempfile.TemporaryDirectory:
    """A new spill directory named after this host and process, after sweeping those of dead processes."""
    sweep_dead_spills(root)
    return tempfile.TemporaryDirectory(prefix=f"{SPILL_PREFIX}{socket.gethostname()}-{os.getpid()}-", dir=root)


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
