"""memgas-cards' graph of a long history in node blocks: what a card-graph-associate task gets instead of the
graph's matrix once its prefix passes one block (``blocks.BLOCK_ROWS`` rows).

The card graph's node ``i`` is MemGAS's nodes and cards interleaved by session
(:func:`memgas.pipeline.card_graph.card_graph_layout`), so its blocks are not MemGAS's: they are built here,
one MemGAS block of sessions at a time (:class:`~memgas.jobs.history_index.node_blocks.HistoryBlocks`'s reader,
stored blocks reused), with the cards of those sessions (their vectors read for that block only), cut into
blocks of ``block_rows`` card-graph rows and handed over as :class:`~memgas.jobs.history_index.node_blocks.HistoryBlocks`
does (Ray's object store, or a spilled ``.npy`` file in-process). The driver holds the card-graph rows of one
MemGAS block of sessions (its four nodes a session and their cards: about five blocks at 16 cards a session)
and the layout (two int64 per node), never the whole matrix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
from memgas.jobs import executor, keys
from memgas.jobs.history_index.node_blocks import HistoryBlocks, spill_directory
from memgas.jobs.stage import StageContext
from memgas.pipeline.association.blocks import NodeBlocks
from memgas.pipeline.association.nodes import NodeFile
from memgas.pipeline.card_graph import CARD, card_graph_layout
from memgas.pipeline.schema import N_GRAN


def card_layout(ctx: StageContext, history: str, cards: Any) -> tuple[list[str], np.ndarray, list[str]]:
    """(session hashes in position order, each kept card's session position, its text) of ``history``, from
    ``cards`` (:func:`memgas.jobs.stages.justmem.current_cards`, a callable of session hashes). Cards in
    session then card order; a session hash repeated in the history gives its cards at its first position
    only (as :class:`memgas.pipeline.justmem.retrieve.HistoryCards`)."""
    t = ctx.bank.read("nodes", ["position", "text_hash"],
                      filter=(pc.field("history_id") == history) & (pc.field("granularity") == "session"))
    t = t.sort_by("position")
    hashes = t["text_hash"].to_pylist()
    first: dict[str, int] = {}
    for p, h in enumerate(hashes):
        first.setdefault(h, p)
    c = cards(sorted(first)).select(["session_hash", "card_index", "text"])
    kept = sorted((first[sh], ci, tx) for sh, ci, tx in zip(*(c[x].to_pylist() for x in c.column_names)))
    return hashes, np.array([p for p, _, _ in kept], np.int64), [tx for _, _, tx in kept]


class CardGraphBlocks:
    """The node blocks of one history's card graph read so far in this stage run, as handles, and its layout
    (``gran``, ``session``, ``starts`` of the whole graph)."""

    def __init__(self, ctx: StageContext, history: str, block_rows: int, cards: Any) -> None:
        self.ctx, self.history, self.block_rows = ctx, history, int(block_rows)
        hashes, self.card_pos, self.card_texts = card_layout(ctx, history, cards)
        self.n_sessions = len(hashes)
        self.gran, self.session, self.starts = card_graph_layout(self.n_sessions, self.card_pos)
        self.memgas = HistoryBlocks(ctx, history, self.block_rows, use_ray=False)  # read here, never handed over
        self.use_ray = ctx.use_ray
        self._spill = None if self.use_ray else spill_directory()
        self.handles: list[Any] = []
        self.pending: list[np.ndarray] = []  # card-graph rows built and not yet cut into a block
        self.next_block = 0  # the next MemGAS block to read
        self.dim = 0

    @property
    def n_nodes(self) -> int:
        return len(self.gran)

    def graph(self, end_session: int) -> dict[str, Any]:
        """The card graph of sessions ``[0, end_session)`` as :meth:`CardGraph.to_arrays` gives it, its nodes as
        :class:`NodeBlocks` (``CardGraph.from_arrays`` keeps them)."""
        n = int(self.starts[end_session]) if end_session < self.n_sessions else self.n_nodes
        return {"nodes": self.nodes(n), "gran": self.gran[:n], "session": self.session[:n],
                "starts": self.starts[:end_session]}

    def nodes(self, n_rows: int) -> NodeBlocks:
        """The first ``n_rows`` node vectors of the card graph, building the blocks not built yet."""
        bs = self.block_rows // N_GRAN  # sessions per MemGAS block
        while len(self.handles) * self.block_rows < n_rows:
            s0 = self.next_block * bs
            if s0 >= self.n_sessions:
                self._cut(final=True)
                break
            s1 = min(self.n_sessions, s0 + bs)
            four = self.memgas.read_blocks(self.next_block, N_GRAN * s1)[self.next_block][: N_GRAN * (s1 - s0)]
            self.dim = four.shape[1]
            lo, hi = np.searchsorted(self.card_pos, [s0, s1])
            texts = self.card_texts[lo:hi]
            a = int(self.starts[s0])
            b = int(self.starts[s1]) if s1 < self.n_sessions else self.n_nodes
            rows = np.empty((b - a, self.dim), np.float32)
            is_card = self.gran[a:b] == CARD
            rows[~is_card] = four
            if texts:
                from memgas.jobs.stages.rank import query_vectors  # at call time: stages import this package

                rows[is_card] = query_vectors(self.ctx.bank, texts, keys.encoder_key(self.ctx))
            del four
            self.pending.append(rows)
            self.next_block += 1
            self._cut(final=s1 >= self.n_sessions)
        return NodeBlocks(self.handles, self.block_rows, n_rows, self.dim, keep=self,
                          fetch=executor.fetch if self.use_ray else None)

    def _cut(self, final: bool) -> None:
        """Hand over every whole block of the pending rows (and, at the graph's end, the rest)."""
        if not self.pending:
            return
        buf = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        B = self.block_rows
        whole = buf.shape[0] // B * B
        for a in range(0, whole, B):
            self.handles.append(self._hand_over(buf[a : a + B]))
        rest = buf[whole:]
        self.pending = [rest] if rest.shape[0] else []
        if final and self.pending:
            pad = -rest.shape[0] % N_GRAN  # whole sessions of four for a NodeFile: zero rows, never read
            self.handles.append(self._hand_over(np.concatenate([rest, np.zeros((pad, rest.shape[1]), np.float32)])))
            self.pending = []

    def _hand_over(self, m: np.ndarray) -> Any:
        return hand_over(m, self._spill, len(self.handles))


def hand_over(m: np.ndarray, spill: Any, i: int) -> Any:
    """Block ``i``'s handle: shared through the executor (Ray's object store; ``spill`` None), or spilled to a
    ``.npy`` file in the directory ``spill`` and read back as a :class:`NodeFile`."""
    if spill is None:
        return executor.share(np.ascontiguousarray(m))
    path = Path(spill.name) / f"{i}.npy"
    np.save(path, np.ascontiguousarray(m))
    return NodeFile(path)


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


def card_graph_blocks(ctx: StageContext, history: str, block_rows: int, cards: Any) -> CardGraphBlocks:
    """``history``'s :class:`CardGraphBlocks`, kept in ``ctx.scratch`` for the next unit of the same history
    (which needs this unit's prefix and more); the other histories' are forgotten (a long history's units come
    one after another in the plan)."""
    cache = ctx.scratch.setdefault("card_graph_blocks", {})
    for h in [h for h in cache if h != history]:
        del cache[h]
    if history not in cache:
        cache[history] = CardGraphBlocks(ctx, history, block_rows, cards)
    return cache[history]
