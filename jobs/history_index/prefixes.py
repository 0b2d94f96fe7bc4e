"""A history's prefix digests: the identity of every structure stored for it.

Sessions ``[0, s)`` of a history are named by the digest of their node texts, chained and seeded with the
encoder keys (:func:`memgas.pipeline.association.segments.prefix_digests`). An edge segment, a stored node
block and a saved IVF index (or delta) are each valid while the digest of the prefix they were computed from
is still the history's: an append adds digests and changes none, a changed session changes every one after
it.
"""

from __future__ import annotations

from memgas.jobs import tables
from memgas.jobs.keys import encoder_keys
from memgas.jobs.stage import StageContext
from memgas.pipeline.association.segments import Segment, prefix_digests
from memgas.pipeline.schema import EDGE_SEGMENTS


def chains(ctx: StageContext) -> dict[str, list[str]]:
    """Per history, the prefix digests of its sessions (:func:`prefix_digests`). The associate stage's plan,
    current parts and finish and the stored blocks' names all need them: computed once per run and state of
    the nodes table (its committed digest)."""
    try:
        digest = tables.read_digest(ctx, "nodes")
    except KeyError:  # a context without the job's pipeline (a library caller): computed, not cached
        digest = None
    key = ("associate:chains", digest, tuple(sorted(encoder_keys(ctx).items())))
    if key[1] is not None and key in ctx.cache:
        return ctx.cache[key]
    seed = "|".join(f"{k}={v}" for k, v in key[2])
    out = prefix_digests(ctx.bank.read("nodes", ["history_id", "position", "granularity", "text_hash"]), seed)
    if key[1] is not None:
        ctx.cache[key] = out
    return out


def stored_segments(ctx: StageContext, prefix: str, segments: str = "edge_segments",
                    edges: str = "edges") -> dict[str, list[Segment]]:
    """Segments of every part of ``segments`` (a table of :data:`EDGE_SEGMENTS` rows) named with ``prefix``
    whose part of ``edges`` is there too: the association's (associate's ``edge_segments`` and ``edges``, or
    memgas-cards' ``card_graph_edge_segments`` and ``card_graph_edges``)."""
    bank, out = ctx.bank, {}
    for part in bank.parts(segments):
        if part.startswith(prefix) and bank.has_part(edges, part):
            t = bank.read(segments, parts=[part])
            out[part] = list(zip(*(t[c].to_pylist() for c in EDGE_SEGMENTS.names)))
    return out
