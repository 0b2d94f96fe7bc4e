"""Which association edges are still valid after the bank changed, and which rows must be computed.

MemGAS's association is causal: the edges of a node (row) depend only on the nodes of its own and earlier
sessions. So the edges of the rows of sessions ``[a, b)`` of a history stay valid for as long as the nodes
of sessions ``[0, b)`` are the same, and an append of sessions needs only the new rows. The associate stage
stores its edges per *segment* ``(history, a, b, prefix digest of sessions [0, b))`` (table
``edge_segments``, in a part named like the edges part it describes), and here:

* :func:`prefix_digests`: per history, the digest of the node identities of sessions ``[0, p)`` for every
  ``p`` (a chain: each session's four text hashes added to the previous digest, seeded with the encoder
  keys, since a node's vector is a function of its text and the encoder key alone);
* :func:`card_prefix_digests`: the same chain for memgas-cards' graph, each session's cards folded in;
* :func:`coverage`: which stored parts are current (every segment they hold continues its history's
  chain of valid segments from session 0) and how many sessions of each history they cover;
* :func:`split_segment`: a huge history's new rows cut into row blocks of about equal causal work (one
  Ray task each; the edges do not depend on the cuts), :func:`split_sized` the same for sessions of any size; :func:`split_every`: the cut of the rows searched
  by IVF (``association.search: ivf``), at fixed multiples of :data:`IVF_UNIT_SESSIONS` sessions.

Everything here is a pure function of tables and lists, so it is tested without running a stage.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memgas.pipeline.schema import GRANULARITIES, N_GRAN

#: (history_id, first_session, end_session, prefix_digest)
Segment = tuple[str, int, int, str]

#: causal work (summed prefix lengths of the rows, in nodes) above which one history's new rows are cut
#: into several units: about 2 x 4096 x 10^6 products, a few minutes of one CPU core
UNIT_WORK = 1 << 33
#: sessions per causal tile (``association.CAUSAL_BLOCK_SESSIONS``): cuts fall on tile edges
TILE_SESSIONS = 64
#: sessions per unit of a history's rows past its exact prefix under ``association.search: ivf`` (524,288
#: rows: their candidates take ~0.27 GB). Each such unit rebuilds the index at its first row (trains the
#: centroids unless a saved index is there, then adds the nodes before its rows), so fewer, longer units cost
#: less CPU in all and more units spread one history over more workers: 8 units at 10^6 sessions.
IVF_UNIT_SESSIONS = 1 << 17
#: the same for memgas-cards' graph, whose sessions add their cards to their four nodes (4-16 with the LLM-free
#: extractor): a quarter of MemGAS's sessions, about as many rows. Cut by causal work instead (as its exact
#: search is), a history of 10^5 sessions made 38 units, each training the centroids and adding the nodes
#: before its rows again: 91 s a unit
CARD_IVF_UNIT_SESSIONS = IVF_UNIT_SESSIONS // 4


def prefix_digests(nodes: pa.Table, seed: str) -> dict[str, list[str]]:
    """Per history (sessions in position order): ``[D_0, D_1, ..., D_S]``, ``D_p`` the identity of the node
    vectors of sessions ``[0, p)`` under ``seed`` (the encoder keys). ``nodes``: the ``nodes`` table."""
    t = nodes.filter(pc.is_in(nodes["granularity"], pa.array(GRANULARITIES)))
    t = t.sort_by([("history_id", "ascending"), ("position", "ascending")])  # stable: a session's rows in order
    n = t.num_rows
    if n == 0:
        return {}
    # per session (a run of equal history and position) its text per granularity, the last row of each
    # winning: Arrow and numpy per row, Python once per session (a loop per node row was ~4 s at 10^6 sessions)
    hid, pos = t["history_id"].combine_chunks(), t["position"].combine_chunks()
    new = np.ones(n, bool)
    if n > 1:
        new[1:] = (pc.not_equal(hid.slice(1), hid.slice(0, n - 1)).to_numpy(zero_copy_only=False)
                   | pc.not_equal(pos.slice(1), pos.slice(0, n - 1)).to_numpy(zero_copy_only=False))
    session = np.cumsum(new) - 1
    starts = np.flatnonzero(new)
    gran = pc.index_in(t["granularity"], value_set=pa.array(GRANULARITIES)).to_numpy(zero_copy_only=False)
    last = np.full(len(starts) * N_GRAN, -1, np.int64)
    np.maximum.at(last, session * N_GRAN + gran, np.arange(n, dtype=np.int64))
    text = t["text_hash"].combine_chunks()
    cols = []
    for g in range(N_GRAN):
        at = last[g::N_GRAN]
        cols.append(pc.fill_null(pc.take(text, pa.array(at, pa.int64(), mask=at < 0)), ""))
    lines = pc.binary_join_element_wise(*cols, "|").to_pylist()
    names = hid.take(pa.array(starts, pa.int64())).to_pylist()
    out: dict[str, list[str]] = {}
    hasher = None
    chain: list[str] = []
    for i, (h, line) in enumerate(zip(names, lines)):
        if i == 0 or h != names[i - 1]:
            hasher = hashlib.blake2b(seed.encode(), digest_size=12)
            chain = out.setdefault(h, [hasher.hexdigest()])
        hasher.update((line + ";").encode())
        chain.append(hasher.copy().hexdigest())
    return out


def card_prefix_digests(chains: Mapping[str, list[str]], sessions: Mapping[str, list[str]],
                        cards: Mapping[str, str], seed: str) -> dict[str, list[str]]:
    """Per history, ``[C_0, ..., C_S]``: ``C_p`` the identity of memgas-cards' graph of sessions ``[0, p)``, its
    MemGAS nodes *and* its cards. ``chains``: :func:`prefix_digests` (the MemGAS nodes); ``sessions``: per
    history its session hashes in position order; ``cards``: per session hash the identity of its cards in
    card order (their text hashes; absent: none); ``seed``: what else names the cards (their extractor's and
    encoder's keys). A session hash repeated in a history adds its cards at its first position only, as the
    graph does (:class:`memgas.pipeline.justmem.retrieve.HistoryCards`). ``C_{p+1}`` chains ``C_p`` with
    ``D_{p+1}`` (which names the MemGAS nodes of the whole prefix) and the cards session ``p`` adds, so an
    append adds digests and changes none, and a changed card changes every digest from its session on."""
    out: dict[str, list[str]] = {}
    for h, chain in chains.items():
        hashes = sessions.get(h, [])
        if len(hashes) != len(chain) - 1:
            raise ValueError(f"history {h!r}: {len(hashes)} session hashes for {len(chain) - 1} sessions of nodes")
        hasher = hashlib.blake2b(f"{seed}|{chain[0]}".encode(), digest_size=12)
        seen: set[str] = set()
        digests = [hasher.hexdigest()]
        for d, s in zip(chain[1:], hashes):
            hasher.update(f"{d}|{'' if s in seen else cards.get(s, '')};".encode())
            seen.add(s)
            digests.append(hasher.hexdigest())
        out[h] = digests
    return out


@dataclass(frozen=True)
class Coverage:
    """The parts that hold current edges, and per history how many sessions' rows they cover."""

    parts: tuple[str, ...]
    covered: dict[str, int]


def coverage(stored: Mapping[str, Iterable[Segment]], chains: Mapping[str, list[str]]) -> Coverage:
    """The current parts among ``stored`` (part -> its segments) under ``chains`` (:func:`prefix_digests`).

    A part is current when every segment it holds is valid (its history exists, is at least ``end_session``
    long and has that prefix digest) *and* continues its history's chain of segments from session 0: a
    part with one stale or orphaned segment is not read at all (its valid segments are recomputed with the
    rest), so no row's edges are ever read twice or from a stale state. Where two parts offer the same
    step, the longer segment wins, then the lower part name: the result does not depend on listing order.
    """
    segs = {p: list(s) for p, s in stored.items()}

    def valid(seg: Segment) -> bool:
        h, a, b, d = seg
        c = chains.get(h)
        return c is not None and 0 <= a < b < len(c) and c[b] == d

    allowed = {p for p, s in segs.items() if s and all(valid(x) for x in s)}
    while True:
        starts: dict[tuple[str, int], list[tuple[int, str]]] = {}
        for p in allowed:
            for h, a, b, _ in segs[p]:
                starts.setdefault((h, a), []).append((-b, p))
        used: dict[str, set[tuple[str, int]]] = {}
        covered: dict[str, int] = {}
        for h in {h for p in allowed for h, *_ in segs[p]}:
            at = 0
            while (h, at) in starts:
                neg_b, p = min(starts[(h, at)])
                used.setdefault(p, set()).add((h, at))
                at = -neg_b
            covered[h] = at
        off_chain = {p for p in allowed if {(h, a) for h, a, *_ in segs[p]} - used.get(p, set())}
        if not off_chain:
            return Coverage(tuple(sorted(allowed)), covered)
        allowed -= off_chain


def causal_work(a: int, b: int, n_gran: int = N_GRAN) -> int:
    """Summed prefix lengths (in nodes) of the rows of sessions ``[a, b)``: each row sees every node of the
    sessions before its own."""
    return n_gran * n_gran * (b * (b - 1) - a * (a - 1)) // 2


def split_segment(a: int, b: int, unit_work: int = UNIT_WORK, tile: int = TILE_SESSIONS) -> list[tuple[int, int]]:
    """``[a, b)`` cut into session ranges of about ``unit_work`` causal work each, cut on tile edges (so
    no tile's product is computed by two units). One range when the work is below ``unit_work``."""
    pieces = -(-causal_work(a, b) // max(1, unit_work))
    if pieces <= 1:
        return [(a, b)]
    cuts = {a, b}
    for j in range(1, pieces):
        s = int(((a * a) + (b * b - a * a) * j / pieces) ** 0.5)  # equal steps of the quadratic work
        s = (s // tile) * tile
        if a < s < b:
            cuts.add(s)
    c = sorted(cuts)
    return list(zip(c[:-1], c[1:]))


def split_sized(a: int, b: int, sizes: Sequence[int], unit_work: int = UNIT_WORK,
                tile: int = TILE_SESSIONS) -> list[tuple[int, int]]:
    """:func:`split_segment` for sessions of any number of nodes (``sizes``: each session's, memgas-cards'
    graph): ``[a, b)`` cut into session ranges of about ``unit_work`` causal work each (a row sees every node of
    the sessions before its own), cut on multiples of ``tile`` sessions. One range when the work is below
    ``unit_work``. The cuts change the units only, never a row's candidates."""
    n = np.asarray(sizes, np.int64)[:b]
    starts = np.concatenate([[0], np.cumsum(n)])
    work = np.concatenate([[0], np.cumsum(n * starts[:-1])])  # work[s]: rows of sessions [0, s)
    pieces = -(-int(work[b] - work[a]) // max(1, unit_work))
    if pieces <= 1:
        return [(a, b)]
    cuts = {a, b}
    for j in range(1, pieces):
        s = int(np.searchsorted(work, work[a] + (work[b] - work[a]) * j / pieces))
        s = (s // tile) * tile
        if a < s < b:
            cuts.add(s)
    c = sorted(cuts)
    return list(zip(c[:-1], c[1:]))


def split_every(a: int, b: int, unit: int) -> list[tuple[int, int]]:
    """``[a, b)`` cut at every multiple of ``unit`` sessions between them: cuts fixed by session ids, so a
    history's units cover the same sessions whatever its length (an append adds units, it moves no cut)."""
    u = max(1, int(unit))
    cuts = [a, *range((a // u + 1) * u, b, u), b] if a < b else []
    return list(zip(cuts[:-1], cuts[1:]))
