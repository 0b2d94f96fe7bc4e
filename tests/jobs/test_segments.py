"""Edge segments: prefix digests, which stored parts are current, and how a huge history's rows are cut."""

from __future__ import annotations

import pyarrow as pa

from memgas.pipeline.association.segments import (card_prefix_digests, causal_work, coverage, prefix_digests, split_every,
                                                  split_segment, split_sized)
from memgas.pipeline.association import split_rows
from memgas.pipeline.schema import NODES


def _nodes(hist: dict[str, list[str]]) -> pa.Table:
    """One row per (history, session, granularity); each session's texts named after ``hist``'s labels."""
    rows = []
    for h, sessions in hist.items():
        for pos, label in enumerate(sessions):
            for g in ("keyword", "session", "summary", "turn", "hybrid"):  # stored order is not node order
                rows.append({"history_id": h, "session_id": f"{h}{pos}", "position": pos, "granularity": g,
                             "text_hash": f"{g}:{label}"})
    return pa.Table.from_pylist(rows[::-1], schema=NODES)


def test_prefix_digests_follow_the_sessions_and_the_seed() -> None:
    d = prefix_digests(_nodes({"a": ["x", "y", "z"], "b": ["x"]}), "enc1")
    assert len(d["a"]) == 4 and len(d["b"]) == 2
    assert d["a"][:2] == d["b"], "the same first session gives the same digest, whatever the history"
    grown = prefix_digests(_nodes({"a": ["x", "y", "z", "w"]}), "enc1")["a"]
    assert grown[:4] == d["a"], "appending a session keeps every earlier digest"
    changed = prefix_digests(_nodes({"a": ["x", "Y", "z"]}), "enc1")["a"]
    assert changed[:2] == d["a"][:2] and changed[2] != d["a"][2] and changed[3] != d["a"][3]
    assert prefix_digests(_nodes({"a": ["x", "y", "z"]}), "enc2")["a"][1] != d["a"][1], "another encoder key"
    hybrid_only = _nodes({"a": ["x", "y", "z"]}).to_pylist()
    for r in hybrid_only:
        if r["granularity"] == "hybrid":
            r["text_hash"] = "other"
    assert prefix_digests(pa.Table.from_pylist(hybrid_only, schema=NODES), "enc1")["a"] == d["a"], \
        "hybrid rows are not association nodes"


def test_card_prefix_digests_follow_the_nodes_and_the_cards() -> None:
    """memgas-cards' chain: an appended session keeps every digest; a changed card, a changed node or another
    seed changes the digests from its session on; a repeated session adds its cards once, as the graph does."""
    hist = {"a": ["x", "y", "x", "z"]}
    base = prefix_digests(_nodes(hist), "enc")
    cards = {"x": "c1,c2", "z": "c3"}
    d = card_prefix_digests(base, hist, cards, "k")["a"]
    assert len(d) == 5 and len(set(d)) == 5
    grown = card_prefix_digests(prefix_digests(_nodes({"a": [*hist["a"], "w"]}), "enc"), {"a": [*hist["a"], "w"]},
                                cards, "k")["a"]
    assert grown[:5] == d, "appending a session keeps every earlier digest"
    changed = card_prefix_digests(base, hist, {**cards, "z": "c4"}, "k")["a"]
    assert changed[:4] == d[:4] and changed[4] != d[4], "a card of the last session changes its digest alone"
    assert card_prefix_digests(base, hist, {**cards, "x": "c1"}, "k")["a"][1] != d[1]
    # the repeated "x" (position 2) adds no cards; another session there with the same cards adds them
    assert card_prefix_digests(base, {"a": ["x", "y", "q", "z"]}, {**cards, "q": "c1,c2"}, "k")["a"][3] != d[3]
    nodes_changed = prefix_digests(_nodes({"a": ["x", "Y", "x", "z"]}), "enc")
    assert card_prefix_digests(nodes_changed, hist, cards, "k")["a"][2] != d[2]
    assert card_prefix_digests(base, hist, cards, "k2")["a"][0] != d[0], "another extractor or encoder key"


def test_coverage_keeps_only_parts_on_a_valid_chain() -> None:
    chains = {"h": ["d0", "d1", "d2", "d3", "d4"], "g": ["e0", "e1", "e2"]}
    stored = {
        "p1": [("h", 0, 2, "d2"), ("g", 0, 2, "e2")],
        "p2": [("h", 2, 4, "d4")],
        "stale": [("h", 2, 3, "old")],  # a digest that no longer matches
        "orphan": [("g", 1, 2, "e2")],  # valid digest but off the chain (g's rows from 1 are in p1)
    }
    cov = coverage(stored, chains)
    assert cov.parts == ("p1", "p2") and cov.covered == {"h": 4, "g": 2}
    # p1 with one stale segment is not read at all: h and g start again from 0, p2 is off the chain
    stored["p1"] = [("h", 0, 2, "d2"), ("g", 0, 2, "stale")]
    cov = coverage(stored, chains)
    assert cov.parts == ()
    assert cov.covered.get("h", 0) == 0 and cov.covered.get("g", 0) == 0
    # a history that shrank (re-ingested shorter) or vanished invalidates its segments
    assert coverage({"p": [("h", 0, 4, "d4")]}, {"h": ["d0", "d1"]}).parts == ()
    assert coverage({"p": [("x", 0, 1, "d1")]}, chains).parts == ()


def test_coverage_prefers_the_longer_segment_then_the_lower_name() -> None:
    chains = {"h": ["d0", "d1", "d2", "d3"]}
    stored = {"b": [("h", 0, 3, "d3")], "a": [("h", 0, 1, "d1")], "c": [("h", 1, 3, "d3")], "a2": [("h", 0, 3, "d3")]}
    cov = coverage(stored, chains)
    assert cov.parts == ("a2",) and cov.covered == {"h": 3}
    assert coverage(dict(reversed(list(stored.items()))), chains) == cov


def test_split_segment_cuts_on_tiles_into_equal_work_and_agrees_with_split_rows() -> None:
    assert split_segment(0, 100) == [(0, 100)]
    pieces = split_segment(0, 10_000, unit_work=causal_work(0, 10_000) // 4)
    assert pieces[0][0] == 0 and pieces[-1][1] == 10_000
    assert all(b == c for (_, b), (c, _) in zip(pieces, pieces[1:]))
    assert all(a % 64 == 0 for a, _ in pieces)
    works = [causal_work(a, b) for a, b in pieces]
    assert len(pieces) == 4 and max(works) < 1.2 * min(works)
    # the same cuts as the library's row blocks (in nodes, 4 per session)
    assert [(4 * a, 4 * b) for a, b in pieces] == split_rows(40_000, 4)
    assert split_segment(9_000, 10_000, unit_work=causal_work(9_000, 10_000) // 2)[0][0] == 9_000


def test_split_sized_weighs_each_session_by_its_nodes() -> None:
    """memgas-cards' cut: four nodes a session gives MemGAS's cut; sessions of 20 nodes (25x the work) give
    more units, each of about the unit's work, cut on tile edges and covering the range."""
    for a, b, u in ((0, 10000, 1 << 28), (3000, 20000, 1 << 29), (0, 100, 1 << 33)):
        assert split_sized(a, b, [4] * b, u) == split_segment(a, b, u)
    sizes = [20] * 3000
    got = split_sized(500, 3000, sizes, 1 << 27)
    assert got[0][0] == 500 and got[-1][1] == 3000 and all(x[1] == y[0] for x, y in zip(got, got[1:]))
    assert len(got) > len(split_segment(500, 3000, 1 << 27)) and all(y % 64 == 0 for _, y in got[:-1])
    work = [sum(20 * 20 * s for s in range(x, y)) for x, y in got]
    assert max(work) < 1.5 * (1 << 27) and min(work[:-1]) > 0.5 * (1 << 27), work


def test_split_every_cuts_at_fixed_multiples() -> None:
    """The IVF units: cuts at multiples of the unit, whatever the first session (an append adds units, moves none)."""
    assert split_every(0, 300, 96) == [(0, 96), (96, 192), (192, 288), (288, 300)]
    assert split_every(250, 360, 96) == [(250, 288), (288, 360)]
    assert split_every(96, 192, 96) == [(96, 192)]
    assert split_every(0, 50, 96) == [(0, 50)]
    assert split_every(7, 7, 96) == []


def _prefix_digests_oracle(nodes: pa.Table, seed: str) -> dict[str, list[str]]:
    """prefix_digests as first written: a Python loop per node row."""
    import hashlib

    import pyarrow.compute as pc

    from memgas.pipeline.schema import GRANULARITIES

    t = nodes.filter(pc.is_in(nodes["granularity"], pa.array(GRANULARITIES)))
    t = t.sort_by([("history_id", "ascending"), ("position", "ascending")])
    order = {g: i for i, g in enumerate(GRANULARITIES)}
    out: dict[str, list[str]] = {}
    hasher, chain, cur, session = None, [], None, [""] * len(GRANULARITIES)

    def close() -> None:
        hasher.update(("|".join(session) + ";").encode())
        chain.append(hasher.copy().hexdigest())

    for h, pos, g, th in zip(*(t[c].to_pylist() for c in ("history_id", "position", "granularity", "text_hash"))):
        if cur is not None and (h, pos) != cur:
            close()
            session = [""] * len(GRANULARITIES)
        if cur is None or h != cur[0]:
            hasher = hashlib.blake2b(seed.encode(), digest_size=12)
            chain = out.setdefault(h, [hasher.hexdigest()])
        cur = (h, pos)
        session[order[g]] = th
    if cur is not None:
        close()
    return out


def test_prefix_digests_equal_a_loop_per_node_row() -> None:
    """Histories of one session and of several, a session missing a granularity, a granularity written twice
    (the last row wins), rows in no order, non-ASCII text ids, and no rows."""
    base = _nodes({"a": ["x", "y", "z"], "b": ["x"], "c": [f"s{i}" for i in range(40)], "é": ["ü", "v"]}).to_pylist()
    rows = [r for r in base if not (r["history_id"] == "c" and r["position"] == 7 and r["granularity"] == "summary")]
    rows.append({**rows[3], "text_hash": "written-again"})
    t = pa.Table.from_pylist(rows[::3] + rows[1::3] + rows[2::3], schema=NODES)
    assert prefix_digests(t, "enc") == _prefix_digests_oracle(t, "enc")
    assert prefix_digests(t.slice(0, 0), "enc") == _prefix_digests_oracle(t.slice(0, 0), "enc") == {}
