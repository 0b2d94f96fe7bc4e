"""Stored node blocks: a long history's node vectors in node order, kept in the bank so that a later run
reads its blocks (the complete ones, and the last one as far as it went) instead of gathering them again
from ``embeddings``.

Why: a history longer than one block reaches the associate and rank tasks as row blocks
(:mod:`memgas.jobs.history_index.node_blocks`). Gathering them means one pass over the whole ``embeddings`` table
(its rows are in text-hash order, not the history's) and a scattered read per node. At 10^6 sessions that
was ~5 of the 6.3 minutes of an append of 1,000 sessions, most of it for blocks the append did not change.
A block of sessions ``[i*bs, (i+1)*bs)`` depends only on the nodes of those sessions and on the encoders,
so a *complete* block stays what it is while its history's prefix ``[0, (i+1)*bs)`` does (an append only
adds sessions after it).

*The last, partial block* is stored too, as what it holds so far: sessions ``[i*bs, c)`` of a history of
``c`` sessions. Each of its session's four rows depends on that session's nodes alone (the turn mean on its
own pairs), so while the prefix ``[0, c)`` is unchanged those rows are the first ``4 (c - i*bs)`` rows of
block ``i`` however long the history grows: an append gathers only the sessions after ``c`` (at 10^6
sessions the partial block's thousands of old sessions had their vectors spread over every row group of the
compacted ``embeddings``, a read of the whole table for each append). A later run reads the stored
partial block back when the history still has ``c`` sessions (the rank stage after the associate stage).

Table ``node_blocks``, one part per block: its rows are the block's node rows in order (one ``vector``
column of float32 bytes, no compression), and its name says which block it is: ``<assembly and encoders>-<history>-<block>-<prefix digest>``,
the prefix digest being :func:`~memgas.jobs.history_index.prefixes.chains`'s digest of sessions
``[0, (i+1)*bs)`` (every node text of those sessions, seeded with the encoder keys); a partial block's is
``<...>-<block>-p<c>-<digest of sessions [0, c)>``, so that it is taken only for that very prefix (its
session count and digest both checked against the history's chain, its rows against the count; ``p`` is no
hex digit, so no complete block's name begins like it). A part is used only under its exact name and after its bytes are
verified against the digest written with it (a damaged one is gathered and written again: never read
silently). The bits are those of the gathered block: the part holds that array.

Who writes: the driver's block reader, whichever stage gathered the block (associate, rank, the latency
probe). It is a cache of the bank, not a stage's output table: no fingerprint reads it, and a part is the
same bytes whoever writes it. A write that fails (a full disk, a read-only bank) is logged and skipped: the
run goes on with the gathered block. A part is written whole, then marked (``Bank.write_part``); a killed
write leaves an unmarked file that is ignored and swept. When a block is written, complete or partial, the
other parts of the same block of the same history (an older prefix, or the partial block it completes or
extends) are dropped. Not dropped: the blocks of histories no longer in
the bank, and of an older block size or assembly (disk only; they are never read).

*Another graph's blocks*: memgas-cards' graph (each session's four nodes and its cards,
:mod:`memgas.jobs.history_index.card_blocks`) is stored here by the same rules, under a stem of its own and
its own prefix digests (the card graph's, which chain each session's cards). Its sessions have any number
of nodes, so block ``i`` ends inside a session: it is complete, and named by the digest of the fewest
sessions whose nodes fill it, once the history holds them; a partial block holds its rows before session
``c``.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pyarrow as pa

from memgas.jobs.stage import short_hash
from memgas.pipeline.bank import Bank
from memgas.pipeline.errors import BankError
from memgas.pipeline.schema import N_GRAN

log = logging.getLogger(__name__)

TABLE = "node_blocks"
#: the node matrix's assembly (``retrieve.stack_nodes``, the block reader's turn means) and the stored format
#: (2: float32 bytes, ``schema.node_blocks_schema``): change it when either changes, so that no block stored
#: before is read
ASSEMBLY_VERSION = "2"


class StoredBlocks:
    """The stored blocks of one history (``chain``: its prefix digests,
    :func:`~memgas.jobs.history_index.prefixes.chains`), block ``i`` = node rows ``[i*block_rows, (i+1)*block_rows)``:
    the complete ones, and the last one as far as the history goes (:meth:`partial`)."""

    def __init__(self, bank: Bank, keys: dict[str, str], history: str, block_rows: int, chain: list[str],
                 ends: np.ndarray | None = None, graph: str | None = None) -> None:
        """Another graph than MemGAS's (memgas-cards', :mod:`~memgas.jobs.history_index.card_blocks`) gives
        ``ends`` (its first ``s`` sessions hold ``ends[s]`` nodes: sessions of any size, so a block may end
        inside a session) and ``graph``, its name, which enters the parts' stem: its blocks are never taken
        for MemGAS's of the same history, nor MemGAS's for its. None, None: four nodes a session, MemGAS's
        names."""
        self.bank, self.history, self.block_rows, self.chain = bank, history, block_rows, chain
        self.block_sessions = block_rows // N_GRAN
        self.ends = None if ends is None else np.asarray(ends, np.int64)
        if self.ends is not None and self.ends.size != len(chain):
            raise ValueError(f"history {history}: {self.ends.size - 1} sessions of nodes for {len(chain) - 1} "
                             "prefix digests")
        assembly = [ASSEMBLY_VERSION, sorted(keys.items()), block_rows] if graph is None else \
            [graph, ASSEMBLY_VERSION, sorted(keys.items()), block_rows]
        self.stem = f"{short_hash(assembly)}-{short_hash(history)}-"
        self.read_blocks = self.written = self.damaged = self.read_partial = self.written_partial = 0

    @property
    def sessions(self) -> int:
        """The history's sessions, as its chain of prefix digests counts them."""
        return len(self.chain) - 1

    def nodes(self, sessions: int) -> int:
        """The node rows of the history's first ``sessions`` sessions."""
        return N_GRAN * sessions if self.ends is None else int(self.ends[sessions])

    def block_end(self, i: int) -> int:
        """The sessions that fill block ``i``: the fewest whose nodes reach its last row (more than the
        history holds when they do not). Its rows are those sessions' nodes, so its identity is their prefix
        digest."""
        if self.ends is None:
            return (i + 1) * self.block_sessions
        return int(np.searchsorted(self.ends, (i + 1) * self.block_rows, side="left"))

    def complete(self, i: int) -> bool:
        return self.block_end(i) <= self.sessions

    def part(self, i: int) -> str:
        return f"{self.stem}{i:07d}-{self.chain[self.block_end(i)][:16]}"

    def partial_part(self, i: int, end: int) -> str:
        """The name of block ``i`` stored as far as session ``end`` (inside the block): the count and the
        digest of the prefix ``[0, end)`` it was gathered under."""
        return f"{self.stem}{i:07d}-p{end:09d}-{self.chain[end][:16]}"

    def get(self, i: int) -> np.ndarray | None:
        """Block ``i`` as stored (float32 ``[block_rows, d]``), or None: not complete, not stored, or damaged
        (logged, counted and then written again by :meth:`put`)."""
        if not self.complete(i):
            return None
        m = self._load(self.part(i), self.block_rows)
        self.read_blocks += m is not None
        return m

    def partial(self, i: int) -> tuple[int, np.ndarray] | None:
        """The longest stored partial block ``i`` that this history still begins with: ``(end, rows)``, the
        block's node rows before session ``end`` (of sessions ``[i*bs, end)`` in MemGAS's graph), which are
        block ``i``'s first rows (``end`` may be the history's end: then they are the whole block). None where
        there is none intact."""
        lo, hi = i * self.block_rows, (i + 1) * self.block_rows
        head = f"{self.stem}{i:07d}-p"
        ends = []
        for name in self.bank.parts(TABLE):
            end = _partial_end(name, head)
            # the count must be inside the block and the history, and the digest that of this history's prefix
            if end is not None and end <= self.sessions and lo < self.nodes(end) < hi and \
                    name == self.partial_part(i, end):
                ends.append(end)
        for end in sorted(ends, reverse=True):
            m = self._load(self.partial_part(i, end), self.nodes(end) - lo)
            if m is not None:
                self.read_partial += 1
                return end, m
        return None

    def _load(self, part: str, rows: int) -> np.ndarray | None:
        """Part ``part``'s rows (float32 ``[rows, d]``), or None: not stored, or damaged (logged and counted)."""
        if not self.bank.has_part(TABLE, part):
            return None
        if not self.bank.verify_part(TABLE, part):
            log.warning("stored node block %s/%s is damaged; gathering it again", TABLE, part)
            self.damaged += 1
            return None
        try:
            col = self.bank.read(TABLE, ["vector"], parts=[part], dedupe=False)["vector"]
        except BankError as e:  # verified, then gone: replaced by another process's run (`answer` reads unlocked)
            log.warning("could not read stored node block %s/%s (%s); gathering it", TABLE, part, e)
            return None
        width = col.type.byte_width
        m = np.empty((len(col), width // 4), np.float32)
        at = 0
        for chunk in col.chunks:  # one copy, into the block (Ray's put copies it again, into its store)
            n = len(chunk)
            m[at : at + n] = np.frombuffer(chunk.buffers()[1], np.float32, n * width // 4,
                                           chunk.offset * width).reshape(n, -1)
            at += n
        if m.shape[0] != rows:
            log.warning("stored node block %s/%s has %d rows, expected %d; gathering it again", TABLE, part,
                        m.shape[0], rows)
            self.damaged += 1
            return None
        return m

    def put(self, i: int, m: np.ndarray) -> None:
        """Store block ``i``: complete, or the history's last block as far as the history goes (``m`` must
        then hold exactly its sessions' rows); then drop the block's other parts (an older prefix, or the
        partial block this one completes or extends)."""
        lo, n = i * self.block_rows, self.nodes(self.sessions)
        if self.complete(i):
            part = self.part(i)
        elif lo < n and m.shape[0] == n - lo:
            part = self.partial_part(i, self.sessions)
        else:
            return
        m = np.ascontiguousarray(m, np.float32)
        vectors = pa.FixedSizeBinaryArray.from_buffers(pa.binary(4 * m.shape[1]), m.shape[0], [None, pa.py_buffer(m)])
        try:
            self.bank.write_part(TABLE, part, pa.table({"vector": vectors}), dim=m.shape[1])
        except OSError as e:
            log.warning("could not store node block %s/%s (%s); the run goes on without it", TABLE, part, e)
            return
        if self.complete(i):
            self.written += 1
        else:
            self.written_partial += 1
        mine = f"{self.stem}{i:07d}-"
        for other in self.bank.parts(TABLE):
            if other.startswith(mine) and other != part:
                self.bank.drop_part(TABLE, other)

    def stats(self) -> dict[str, Any]:
        return {"read": self.read_blocks, "written": self.written, "damaged": self.damaged,
                "read_partial": self.read_partial, "written_partial": self.written_partial}


def _partial_end(name: str, head: str) -> int | None:
    """The session count in a partial block's name that begins with ``head`` (``<...>-p``), else None."""
    if not name.startswith(head):
        return None
    count = name[len(head):].split("-", 1)[0]
    return int(count) if count.isdigit() else None
