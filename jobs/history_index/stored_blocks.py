"""Stored node blocks: a long history's node vectors in node order, kept in the bank so that a later run
reads its complete blocks instead of gathering them again from ``embeddings``.

Why: a history longer than one block reaches the associate and rank tasks as row blocks
(:mod:`memgas.jobs.history_index.node_blocks`). Gathering them means one pass over the whole ``embeddings`` table
(its rows are in text-hash order, not the history's) and a scattered read per node. At 10^6 sessions that
was ~5 of the 6.3 minutes of an append of 1,000 sessions, most of it for blocks the append did not change.
A block of sessions ``[i*bs, (i+1)*bs)`` depends only on the nodes of those sessions and on the encoders,
so a *complete* block stays what it is while its history's prefix ``[0, (i+1)*bs)`` does (an append only
adds sessions after it). The last, partial block is never stored: an append changes it.

Table ``node_blocks``, one part per block: its rows are the block's node rows in order (one ``vector``
column of float32 bytes, no compression), and its name says which block it is: ``<assembly and encoders>-<history>-<block>-<prefix digest>``,
the prefix digest being :func:`~memgas.jobs.history_index.prefixes.chains`'s digest of sessions
``[0, (i+1)*bs)`` (every node text of those sessions, seeded with the encoder keys). A part is used only under its exact name and after its bytes are
verified against the digest written with it (a damaged one is gathered and written again: never read
silently). The bits are those of the gathered block: the part holds that array.

Who writes: the driver's block reader, whichever stage gathered the block (associate, rank, the latency
probe). It is a cache of the bank, not a stage's output table: no fingerprint reads it, and a part is the
same bytes whoever writes it. A write that fails (a full disk, a read-only bank) is logged and skipped: the
run goes on with the gathered block. A part is written whole, then marked (``Bank.write_part``); a killed
write leaves an unmarked file that is ignored and swept. When a block is written, the other parts of the same
block of the same history (an older prefix) are dropped. Not dropped: the blocks of histories no longer in
the bank, and of an older block size or assembly (disk only; they are never read).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pyarrow as pa

from memgas.jobs.stage import short_hash
from memgas.pipeline.bank import Bank
from memgas.pipeline.schema import N_GRAN

log = logging.getLogger(__name__)

TABLE = "node_blocks"
#: the node matrix's assembly (``retrieve.stack_nodes``, the block reader's turn means) and the stored format
#: (2: float32 bytes, ``schema.node_blocks_schema``): change it when either changes, so that no block stored
#: before is read
ASSEMBLY_VERSION = "2"


class StoredBlocks:
    """The stored complete blocks of one history (``chain``: its prefix digests,
    :func:`~memgas.jobs.history_index.prefixes.chains`), block ``i`` = node rows ``[i*block_rows, (i+1)*block_rows)``."""

    def __init__(self, bank: Bank, keys: dict[str, str], history: str, block_rows: int, chain: list[str]) -> None:
        self.bank, self.history, self.block_rows, self.chain = bank, history, block_rows, chain
        self.block_sessions = block_rows // N_GRAN
        self.stem = f"{short_hash([ASSEMBLY_VERSION, sorted(keys.items()), block_rows])}-{short_hash(history)}-"
        self.read_blocks = self.written = self.damaged = 0

    def complete(self, i: int) -> bool:
        return (i + 1) * self.block_sessions <= len(self.chain) - 1

    def part(self, i: int) -> str:
        return f"{self.stem}{i:07d}-{self.chain[(i + 1) * self.block_sessions][:16]}"

    def get(self, i: int) -> np.ndarray | None:
        """Block ``i`` as stored (float32 ``[block_rows, d]``), or None: not complete, not stored, or damaged
        (logged, counted and then written again by :meth:`put`)."""
        if not self.complete(i) or not self.bank.has_part(TABLE, self.part(i)):
            return None
        part = self.part(i)
        if not self.bank.verify_part(TABLE, part):
            log.warning("stored node block %s/%s is damaged; gathering it again", TABLE, part)
            self.damaged += 1
            return None
        col = self.bank.read(TABLE, ["vector"], parts=[part], dedupe=False)["vector"]
        width = col.type.byte_width
        m = np.empty((len(col), width // 4), np.float32)
        at = 0
        for chunk in col.chunks:  # one copy, into the block (Ray's put copies it again, into its store)
            n = len(chunk)
            m[at : at + n] = np.frombuffer(chunk.buffers()[1], np.float32, n * width // 4,
                                           chunk.offset * width).reshape(n, -1)
            at += n
        if m.shape[0] != self.block_rows:
            log.warning("stored node block %s/%s has %d rows, expected %d; gathering it again", TABLE, part,
                        m.shape[0], self.block_rows)
            self.damaged += 1
            return None
        self.read_blocks += 1
        return m

    def put(self, i: int, m: np.ndarray) -> None:
        """Store block ``i`` (when complete), then drop the block's other parts (an older prefix)."""
        if not self.complete(i):
            return
        part = self.part(i)
        m = np.ascontiguousarray(m, np.float32)
        vectors = pa.FixedSizeBinaryArray.from_buffers(pa.binary(4 * m.shape[1]), m.shape[0], [None, pa.py_buffer(m)])
        try:
            self.bank.write_part(TABLE, part, pa.table({"vector": vectors}), dim=m.shape[1])
        except OSError as e:
            log.warning("could not store node block %s/%s (%s); the run goes on without it", TABLE, part, e)
            return
        self.written += 1
        mine = f"{self.stem}{i:07d}-"
        for other in self.bank.parts(TABLE):
            if other.startswith(mine) and other != part:
                self.bank.drop_part(TABLE, other)

    def stats(self) -> dict[str, Any]:
        return {"read": self.read_blocks, "written": self.written, "damaged": self.damaged}
