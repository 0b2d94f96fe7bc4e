"""memgas-cards' graph of a long history in node blocks: what a card-graph-associate task gets instead of the
graph's matrix once its prefix passes one block (``blocks.BLOCK_ROWS`` rows).

The card graph's node ``i`` is MemGAS's nodes and cards interleaved by session
(:func:`memgas.pipeline.card_graph.card_graph_layout`), so its blocks are not MemGAS's. They are MemGAS's
machinery all the same (:class:`CardGraphBlocks` is a
:class:`~memgas.jobs.history_index.node_blocks.HistoryBlocks`): stored in table ``node_blocks``
(:class:`~memgas.jobs.history_index.stored_blocks.StoredBlocks` under the card graph's own stem, prefix
digests and layout), the complete ones and the last one as far as the history goes, so that an append builds
only the rows of its own sessions; handed over as MemGAS's (Ray's object store, or a spilled ``.npy`` file
in-process), in full, or as the rows an append's search found (``sparse_nodes``,
:mod:`memgas.jobs.history_index.card_ivf`).

A block not stored is built from its sessions' MemGAS rows (MemGAS's own blocks, read through
:class:`~memgas.jobs.history_index.node_blocks.HistoryBlocks`, stored ones reused) and their cards' vectors
(gathered from ``embeddings`` in one pass for all the sessions from the first one built:
:class:`~memgas.pipeline.spilled_vectors.SpilledVectors`). The driver holds a block or two of rows and the
layout (two int64 per node), never the whole matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from memgas.jobs import executor, keys
from memgas.jobs.history_index.node_blocks import HistoryBlocks, spill_directory
from memgas.jobs.history_index.stored_blocks import StoredBlocks
from memgas.jobs.stage import StageContext
from memgas.pipeline.association.blocks import NodeBlocks, SparseBlock
from memgas.pipeline.association.nodes import NodeFile
from memgas.pipeline.card_graph import CARD, card_graph_layout
from memgas.pipeline.errors import BankError
from memgas.pipeline.schema import N_GRAN

#: the card graph's name in its stored blocks' stem: never read as MemGAS's blocks of the same history
GRAPH = "memgas-cards"

#: ``card_hashes(s0, s1)``: the text hashes of the cards of sessions ``[s0, s1)`` in node order
CardHashes = Callable[[int, int], list[str]]


class CardGraphBlocks(HistoryBlocks):
    """The node blocks of one history's card graph read so far in this stage run, as handles, and its layout
    (``gran``, ``session``, ``starts`` of the whole graph, from ``sizes``: each session's nodes)."""

    def __init__(self, ctx: StageContext, history: str, block_rows: int, sizes: np.ndarray, chain: list[str],
                 card_hashes: CardHashes) -> None:
        """``chain``: the card graph's prefix digests (what its stored blocks are named by), ``card_hashes``
        as :data:`CardHashes`."""
        self.ctx, self.chain, self.card_hashes = ctx, chain, card_hashes
        self.sizes = np.asarray(sizes, np.int64)
        self.n_sessions = int(self.sizes.size)
        self.ends = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)  # session s: [ends[s], ends[s+1])
        self.card_ends = np.concatenate([[0], np.cumsum(self.sizes - N_GRAN)]).astype(np.int64)  # its cards, likewise
        self.gran, self.session, self.starts = card_graph_layout(
            self.n_sessions, np.repeat(np.arange(self.n_sessions, dtype=np.int64), self.sizes - N_GRAN))
        self.encoder = keys.encoder_key(ctx)
        super().__init__(ctx, history, block_rows)
        self.memgas = HistoryBlocks(ctx, history, block_rows, use_ray=False)  # read here, never handed over
        self._memgas_last: tuple[int, np.ndarray] | None = None
        self._memgas_next = 0  # MemGAS's blocks are read in order: an earlier one needs a reader of its own
        self._cards: _CardVectors | None = None

    def _stored_blocks(self, ctx: StageContext, history: str, block_rows: int) -> StoredBlocks:
        """The card graph's stored blocks: its own stem, prefix digests (which chain each session's cards) and
        layout, so that no block survives a change of an earlier session or card."""
        return StoredBlocks(ctx.bank, self.keys, history, block_rows, self.chain, ends=self.ends, graph=GRAPH)

    @property
    def n_nodes(self) -> int:
        return int(self.ends[-1])

    def nodes_of(self, sessions: int) -> int:
        """The nodes of the graph's first ``sessions`` sessions."""
        return int(self.ends[sessions])

    def graph(self, end_session: int) -> dict[str, Any]:
        """The card graph of sessions ``[0, end_session)`` as :meth:`CardGraph.to_arrays` gives it, its nodes as
        :class:`NodeBlocks` (``CardGraph.from_arrays`` keeps them)."""
        return layout(self, end_session, self.nodes(self.nodes_of(end_session)))

    def _block(self, i: int) -> np.ndarray:
        """Block ``i``: stored, else built (and then stored: complete, or as far as the history goes). A stored
        partial block that this history begins with gives its first rows, and only the sessions after it are
        built (an append's)."""
        m = self.stored.get(i)
        if m is not None:
            return m
        lo, hi = i * self.block_rows, min((i + 1) * self.block_rows, self.n_nodes)
        if lo >= hi:
            raise BankError(f"{self.bank.path}: the card graph of history {self.history!r} has no node block {i} "
                            f"({self.n_nodes} nodes)")
        have = self.stored.partial(i)
        if have is not None and self.nodes_of(have[0]) >= hi:
            return have[1]  # stored as far as the history goes
        s0 = have[0] if have is not None else int(np.searchsorted(self.ends, lo, side="right")) - 1
        s1 = int(np.searchsorted(self.ends, hi, side="left"))  # the fewest sessions whose nodes reach ``hi``
        start = lo if have is None else self.nodes_of(s0)
        rows = self._session_rows(s0, s1)[start - self.nodes_of(s0) : hi - self.nodes_of(s0)]
        m = rows if have is None else np.concatenate([have[1], rows])
        del rows, have
        self.stored.put(i, m)
        return m

    def _session_rows(self, s0: int, s1: int) -> np.ndarray:
        """float32 rows of sessions ``[s0, s1)``: each session's four MemGAS rows, then its cards' vectors
        (the bits of :func:`memgas.pipeline.card_graph.build_card_graph` on the whole matrices)."""
        four = self._memgas_rows(s0, s1)
        a, b = self.nodes_of(s0), self.nodes_of(s1)
        is_card = self.gran[a:b] == CARD
        rows = np.empty((b - a, four.shape[1]), np.float32)
        rows[~is_card] = four
        if is_card.any():
            rows[is_card] = self._card_rows(s0, s1)
        return rows

    def _memgas_rows(self, s0: int, s1: int) -> np.ndarray:
        """MemGAS's float32 rows of sessions ``[s0, s1)`` (four a session), from its blocks."""
        bs = self.block_rows // N_GRAN
        out = []
        for j in range(s0 // bs, (s1 - 1) // bs + 1):
            a, b = max(s0, j * bs) - j * bs, min(s1, (j + 1) * bs) - j * bs
            out.append(self._memgas_block(j)[N_GRAN * a : N_GRAN * b])
        return np.concatenate(out) if len(out) > 1 else out[0]

    def _memgas_block(self, j: int) -> np.ndarray:
        """MemGAS's block ``j`` (the last one read is kept: a card-graph block's sessions may span two)."""
        if self._memgas_last is not None and self._memgas_last[0] == j:
            return self._memgas_last[1]
        self._memgas_last = None
        if j < self._memgas_next:  # its reader gathers from a later session on: a reader of its own
            self.memgas = HistoryBlocks(self.ctx, self.history, self.block_rows, use_ray=False)
        m = self.memgas.read_blocks(j, (j + 1) * self.block_rows)[j]
        self._memgas_next, self._memgas_last = j + 1, (j, m)
        return m

    def _card_rows(self, s0: int, s1: int) -> np.ndarray:
        """float32 vectors of the cards of sessions ``[s0, s1)`` in node order. The vectors of every card from
        session ``s0`` to the history's end are gathered at the first call (one pass over ``embeddings``,
        newest parts first: an append's are in the parts its encoder just wrote), and again only for an
        earlier session."""
        if self._cards is None or s0 < self._cards.first:
            self._cards = None
            self._cards = _CardVectors(self.bank, self.encoder, s0, int(self.card_ends[s0]),
                                       self.card_hashes(s0, self.n_sessions))
        return self._cards.rows(int(self.card_ends[s0]), int(self.card_ends[s1]))

    def _hand_over(self, m: np.ndarray | SparseBlock, i: int) -> Any:
        """As MemGAS's; a spilled block of a row count that is not whole sessions of four (the graph's last
        block) is padded with zero rows, never read: a :class:`NodeFile` holds whole sessions of four."""
        if not self.use_ray and isinstance(m, np.ndarray) and m.shape[0] % N_GRAN:
            m = np.concatenate([m, np.zeros((-m.shape[0] % N_GRAN, m.shape[1]), np.float32)])
        return super()._hand_over(m, i)


class _CardVectors:
    """The vectors of the cards from one session of a history on: their text hashes in node order (the
    first being the history's card ``offset``) and the spill file they were gathered to."""

    def __init__(self, bank: Any, encoder: str, first: int, offset: int, hashes: list[str]) -> None:
        from memgas.pipeline.spilled_vectors import SpilledVectors, fixed_hashes

        self.first, self.offset, self.encoder = first, offset, encoder
        arr = pa.array(hashes, pa.string())
        self.vectors = SpilledVectors(bank, {encoder: arr})
        self.hashes = fixed_hashes(arr, self.vectors.width)

    def rows(self, a: int, b: int) -> np.ndarray:
        """float32 vectors of the history's cards ``[a, b)``."""
        want = self.hashes[a - self.offset : b - self.offset]
        if want.size != b - a:
            raise BankError(f"cards [{a}, {b}) of a history whose cards from {self.offset} on are "
                            f"{self.hashes.size}")
        return self.vectors.vectors_at(self.vectors.slots_of(self.encoder, want))


def layout(g: Any, end_session: int, nodes: Any) -> dict[str, Any]:
    """The arrays of the card graph ``g`` (its ``gran``, ``session``, ``starts``) of sessions
    ``[0, end_session)``, with ``nodes`` as its vectors."""
    n = int(g.starts[end_session]) if end_session < len(g.starts) else len(g.gran)
    return {"nodes": nodes, "gran": g.gran[:n], "session": g.session[:n], "starts": g.starts[:end_session]}


def matrix_blocks(ctx: StageContext, m: np.ndarray, block_rows: int) -> NodeBlocks:
    """A card graph's matrix built whole (its MemGAS nodes fit one block, its cards make it longer) handed over
    as :class:`NodeBlocks` of ``block_rows`` rows, as :class:`CardGraphBlocks` hands over a long history's."""
    spill = None if ctx.use_ray else spill_directory()
    B, n = int(block_rows), m.shape[0]
    handles = []
    for a in range(0, n, B):
        blk = m[a : a + B]
        pad = -blk.shape[0] % N_GRAN  # whole sessions of four for a NodeFile: zero rows, never read
        handles.append(hand_over(np.concatenate([blk, np.zeros((pad, m.shape[1]), np.float32)]) if pad else blk,
                                 spill, len(handles)))
    return NodeBlocks(handles, B, n, m.shape[1], keep=spill, fetch=executor.fetch if ctx.use_ray else None)


def hand_over(m: np.ndarray, spill: Any, i: int) -> Any:
    """Block ``i``'s handle: shared through the executor (Ray's object store; ``spill`` None), or spilled to a
    ``.npy`` file in the directory ``spill`` and read back as a :class:`NodeFile`."""
    if spill is None:
        return executor.share(np.ascontiguousarray(m))
    path = Path(spill.name) / f"{i}.npy"
    np.save(path, np.ascontiguousarray(m))
    return NodeFile(path)


def card_graph_blocks(ctx: StageContext, history: str, block_rows: int, sizes: np.ndarray, chain: list[str],
                      card_hashes: CardHashes) -> CardGraphBlocks:
    """``history``'s :class:`CardGraphBlocks`, kept in ``ctx.scratch`` for the next unit of the same history
    (which needs this unit's prefix and more); the other histories' are forgotten (a long history's units come
    one after another in the plan)."""
    cache = ctx.scratch.setdefault("card_graph_blocks", {})
    for h in [h for h in cache if h != history]:
        del cache[h]
    if history not in cache:
        cache[history] = CardGraphBlocks(ctx, history, block_rows, sizes, chain, card_hashes)
    return cache[history]
