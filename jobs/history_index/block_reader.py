"""Reading a long history's node vectors from the bank, a block of whole sessions at a time.

A history longer than one block is read by position range (its nodes rows, then the pairs and embeddings of
those texts only), never whole: :class:`HistoryBlockReader` gathers block ``i`` with the bits of the whole
history's matrix. What a block becomes next (stored, handed over to a task) is
:mod:`memgas.jobs.history_index.node_blocks`'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from memgas.pipeline.bank import Bank
from memgas.pipeline.errors import BankError
from memgas.pipeline.schema import GRANULARITIES, N_GRAN

if TYPE_CHECKING:
    from memgas.pipeline.spilled_vectors import SpilledVectors


#: rows per batch of the block reader's table reads (12 MiB of embeddings at d = 384): a block's rows are
#: picked out of the tables batch by batch, never a whole row group (``Bank.read(batch_rows=...)``)
READ_BATCH_ROWS = 8192
#: node (or pair) rows whose hashes the block reader turns into slots at a time
LAYOUT_CHUNK_ROWS = 65536


class HistoryBlockReader:
    """Node vectors of one history, block ``i`` = sessions ``[i*bs, (i+1)*bs)`` (``bs = block_rows / 4``) in
    position order, read from the bank under the encoder keys ``keys`` (:func:`encoder_keys`).

    The history's ``nodes`` and ``pairs`` rows are read once, with its vectors (:meth:`_prepare`), and kept
    as arrays of spill-file slots (:class:`_Layout`); a block is then gathered from the slots
    (:meth:`read`). Each block used to build a :class:`~memgas.pipeline.granularity.MatrixLoader`, which
    read ``nodes`` and ``pairs`` again with a filter (a scan of each table per block) and looked every hash
    up in Python: at 10^6 sessions about half of the reader's time. The bits are those of
    ``node_matrix(MatrixLoader(...).get(history))`` (tests/jobs/test_node_blocks.py checks them on
    sessions with several pairs, none, and a session repeated)."""

    def __init__(self, bank: Bank, keys: dict[str, str], history: str, block_rows: int,
                 from_session: int = 0) -> None:
        """``from_session``: the first session read (the sessions before it are stored, as complete blocks
        and the first sessions of a partial one, :mod:`memgas.jobs.history_index.stored_blocks`): only the
        nodes, pairs and vectors of sessions from there on are gathered."""
        self.bank, self.keys, self.history = bank, keys, history
        self.block_sessions = block_rows // N_GRAN
        # the history's session positions: one int column (the rest is read on the first block)
        t = bank.read("nodes", ["history_id", "granularity", "position"], dedupe=False, batch_rows=READ_BATCH_ROWS,
                      filter=(pc.field("history_id") == history) & (pc.field("granularity") == "session"))
        self.positions = np.unique(t["position"].to_numpy())
        self.first = int(from_session)
        self._vectors: SpilledVectors | None = None
        self._layout: _Layout | None = None

    def _prepare(self) -> _Layout:
        """Every vector of the history's sessions from ``first`` on, gathered in one pass over ``embeddings``
        (:mod:`memgas.pipeline.spilled_vectors`: reading them block by block scanned the whole table once per
        block), and their nodes and pairs as slots of that spill file."""
        if self._layout is None:
            from memgas.pipeline.spilled_vectors import SpilledVectors

            mine = pc.field("history_id") == self.history
            if 0 < self.first < self.positions.size:
                mine = mine & (pc.field("position") >= int(self.positions[self.first]))
            nodes = self.bank.read("nodes", ["position", "granularity", "text_hash"], batch_rows=READ_BATCH_ROWS,
                                   filter=mine)
            nodes = nodes.sort_by([("position", "ascending")])  # stable: MatrixLoader's order
            gran = nodes["granularity"]
            sessions = nodes.filter(pc.equal(gran, "session"))["text_hash"]
            pairs = self.bank.read("pairs", ["session_hash", "pair_index", "text_hash"], batch_rows=READ_BATCH_ROWS,
                                   filter=pc.field("session_hash").isin(pc.unique(sessions)))
            pairs = pairs.sort_by([("session_hash", "ascending"), ("pair_index", "ascending")])
            by_role = {"main": nodes.filter(pc.invert(pc.is_in(gran, pa.array(["session", "turn"]))))["text_hash"],
                       "session": sessions, "pair": pairs["text_hash"]}
            need: dict[str, list] = {}
            for role, hashes in by_role.items():  # one list per encoder key (roles may share one)
                need.setdefault(self.keys[role], []).extend(hashes.chunks)
            self._vectors = SpilledVectors(self.bank, {k: pa.chunked_array(c, pa.string()) for k, c in need.items()})
            self._layout = _Layout.of(nodes, pairs, self.positions[self.first:], self._vectors, self.keys)
        return self._layout

    @property
    def n_sessions(self) -> int:
        return int(self.positions.size)

    def read(self, i: int) -> np.ndarray:
        """float32 ``[4*(s1-s0), d]``: the rows of block ``i``, those of the whole history's matrix."""
        if not self.first <= i * self.block_sessions < self.n_sessions:
            raise BankError(f"{self.bank.path}: history {self.history!r} has no node block {i} "
                            f"({self.n_sessions} sessions, read from session {self.first})")
        return self.read_sessions(i * self.block_sessions, min(self.n_sessions, (i + 1) * self.block_sessions))

    def read_sessions(self, s0: int, s1: int) -> np.ndarray:
        """float32 ``[4*(s1-s0), d]``: the rows of sessions ``[s0, s1)`` (within one block), those of the
        whole history's matrix: each session's rows depend on its own nodes and pairs only, so a block may be
        its stored first sessions followed by these (:mod:`memgas.jobs.history_index.stored_blocks`)."""
        from memgas.pipeline.retrieve import stack_nodes

        if not self.first <= s0 < s1 <= self.n_sessions:
            raise BankError(f"{self.bank.path}: history {self.history!r} has no sessions [{s0}, {s1}) "
                            f"({self.n_sessions} sessions, read from session {self.first})")
        lay = self._prepare()
        rows = lay.block_rows(s0 - self.first, s1 - self.first)
        if any(r.size != s1 - s0 for r in rows):
            raise BankError(f"{self.bank.path}: history {self.history!r}: sessions [{s0}, {s1}) have "
                            f"{sum(r.size for r in rows)} nodes, expected {N_GRAN * (s1 - s0)}")
        vec = self._vectors
        session, summary, keyword = (vec.vectors_at(lay.slot[rows[g]]) for g in (0, 2, 3))
        return stack_nodes(session, lay.turns(rows[1], vec), summary, keyword)


class _Layout:
    """One history's nodes in position order as spill-file slots, ~45 bytes a session (int32 indices):
    per node row ``granularity`` (0-3: session, turn, summary, keyword; -1 another kind) and ``slot`` (its
    vector's; a turn node's: its session vector's, the turn vector of a session without pairs); per session
    (of the reader's ``positions``) its node rows ``[start, end)``; per turn node (``turn_rows``) the range of
    its session's pairs in ``pair_slot`` (pairs sorted by session hash, then pair index: MatrixLoader's)."""

    def __init__(self, granularity: np.ndarray, slot: np.ndarray, start: np.ndarray, end: np.ndarray,
                 turn_rows: np.ndarray, pair_lo: np.ndarray, pair_hi: np.ndarray, pair_slot: np.ndarray) -> None:
        self.granularity, self.slot, self.start, self.end = granularity, slot, start, end
        self.turn_rows, self.pair_lo, self.pair_hi, self.pair_slot = turn_rows, pair_lo, pair_hi, pair_slot

    @classmethod
    def of(cls, nodes: pa.Table, pairs: pa.Table, positions: np.ndarray, vectors: SpilledVectors,
           keys: dict[str, str]) -> _Layout:
        """``nodes`` sorted by position, ``pairs`` by session hash and pair index; ``positions``: the sessions'.
        Indices are int32 (half the memory; checked to fit), and the hashes are turned into slots
        :data:`LAYOUT_CHUNK_ROWS` rows at a time, so only a chunk of them is ever held."""
        from memgas.pipeline.spilled_vectors import fixed_hashes

        if max(nodes.num_rows, pairs.num_rows, vectors.slots) >= 2**31:
            raise BankError(f"history with {nodes.num_rows} nodes, {pairs.num_rows} pairs: more than the block "
                            "reader's int32 indices hold")
        node_pos = nodes["position"].to_numpy()
        start = np.searchsorted(node_pos, positions, side="left").astype(np.int32)
        end = np.searchsorted(node_pos, positions, side="right").astype(np.int32)
        del node_pos
        pair_sess = fixed_hashes(pairs["session_hash"], vectors.width)
        gran = np.empty(nodes.num_rows, np.int8)
        slot = np.full(nodes.num_rows, -1, np.int32)
        turn_rows, pair_lo, pair_hi = [], [], []
        for a in range(0, nodes.num_rows, LAYOUT_CHUNK_ROWS):
            chunk = nodes.slice(a, LAYOUT_CHUNK_ROWS)
            # codes by Arrow (no Python string per row): 0-3 = session, turn, summary, keyword; -1 any other
            code = pc.index_in(chunk["granularity"], value_set=pa.array(GRANULARITIES))
            g = pc.fill_null(code, -1).to_numpy().astype(np.int8)
            gran[a : a + g.size] = g
            hashes = fixed_hashes(chunk["text_hash"], vectors.width)
            for gs, role in (((0, 1), "session"), ((2, 3), "main")):
                m = np.isin(g, gs)
                slot[a + np.flatnonzero(m)] = vectors.slots_of(keys[role], hashes[m])
            turn = np.flatnonzero(g == 1)
            turn_rows.append((a + turn).astype(np.int32))
            pair_lo.append(np.searchsorted(pair_sess, hashes[turn], side="left").astype(np.int32))
            pair_hi.append(np.searchsorted(pair_sess, hashes[turn], side="right").astype(np.int32))
        del pair_sess
        pair_slot = np.empty(pairs.num_rows, np.int32)
        for a in range(0, pairs.num_rows, LAYOUT_CHUNK_ROWS):
            hashes = fixed_hashes(pairs["text_hash"].slice(a, LAYOUT_CHUNK_ROWS), vectors.width)
            pair_slot[a : a + hashes.size] = vectors.slots_of(keys["pair"], hashes)
        empty = np.zeros(0, np.int32)
        return cls(gran, slot, start, end, np.concatenate([empty, *turn_rows]), np.concatenate([empty, *pair_lo]),
                   np.concatenate([empty, *pair_hi]), pair_slot)

    def block_rows(self, s0: int, s1: int) -> list[np.ndarray]:
        """Per granularity 0-3, the node rows of sessions ``[s0, s1)`` in position order."""
        a, b = int(self.start[s0]), int(self.end[s1 - 1])
        return [a + np.flatnonzero(self.granularity[a:b] == g) for g in range(N_GRAN)]

    def turns(self, rows: np.ndarray, vectors: SpilledVectors) -> np.ndarray:
        """float32 turn vectors of the turn nodes ``rows``: the mean of its session's pair vectors (a sum in
        pair order, then divided by the count, as MatrixLoader computes it), or its session vector when the
        session has no pairs."""
        out = vectors.vectors_at(self.slot[rows])  # the session vectors; rows with pairs are replaced below
        t = np.searchsorted(self.turn_rows, rows)
        lo, hi = self.pair_lo[t], self.pair_hi[t]
        has = hi > lo
        if has.any():
            # each session once (a repeated session's turn nodes share the vector), in hash order like the loader
            uniq, first, back = np.unique(lo[has], return_index=True, return_inverse=True)
            counts = (hi[has][first] - uniq).astype(np.int64)
            out[has] = (_pair_sums(vectors, self.pair_slot, uniq, counts) / counts[:, None]).astype(np.float32)[back.ravel()]
        return out


def _pair_sums(vectors: SpilledVectors, pair_slot: np.ndarray, first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """float32 sums of each session's pair vectors (pairs ``first[j] .. first[j] + counts[j] - 1`` of
    ``pair_slot``) by ``np.add.reduceat``, as MatrixLoader sums them: its order of additions within a
    segment is NumPy's (for three rows it is not left to right), so no other sum gives the same bits."""
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    take = np.repeat(first - starts, counts) + np.arange(int(counts.sum()))  # each session's pair rows, in order
    return np.add.reduceat(vectors.vectors_at(pair_slot[take]), starts, axis=0)
