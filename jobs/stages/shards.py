"""What the kernel stages over shards of histories (associate, rank, the card-graph stages) share: their
activity, their units, the node matrices they read and the edge rows the associators write."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs.keys import encoder_keys
from memgas.jobs.placement import kernel_device
from memgas.jobs.stage import Active, StageContext
from memgas.jobs.units import chunk


def owned(a: Any, dtype: Any = None) -> np.ndarray:
    """A C-contiguous, aligned, writeable copy where needed. Arrays that come out of Ray's object store are
    read-only views that may be unaligned; NumPy then skips BLAS for a matmul and sums in another order, so a
    task would not give the bits of the same computation in-process."""
    return np.require(a, dtype=dtype, requirements=["C", "A", "W", "O"])


def node_matrix(m: dict[str, Any]) -> np.ndarray:
    from memgas.pipeline.retrieve import stack_nodes

    return stack_nodes(m["session"], m["turn"], m["summary"], m["keyword"])


def matrix_loader(ctx: StageContext, history_ids: list[str]) -> Any:
    """Node matrices of ``history_ids`` under this config's encoder keys (pairs and sessions under their
    windows' keys). The unit's rows of ``nodes``, ``pairs`` and ``embeddings`` are read a batch at a time
    (the same rows): a plain filtered read decodes many row groups of the whole table at once, and a unit
    needs a few of its vectors (at 60 histories the driver's peak was ~0.4 GB higher a unit)."""
    from memgas.jobs.history_index import READ_BATCH_ROWS
    from memgas.pipeline.granularity import MatrixLoader

    keys = encoder_keys(ctx)
    nodes = ctx.bank.read("nodes", filter=pc.field("history_id").isin(list(history_ids)), batch_rows=READ_BATCH_ROWS)
    return MatrixLoader(ctx.bank, keys["main"], history_ids=history_ids, pair_encoder=keys["pair"],
                        nodes=nodes if nodes.num_rows else None,  # none: the loader says what is missing
                        session_encoder=keys["session"], batch_rows=READ_BATCH_ROWS)


def kernel_active(ctx: StageContext) -> Active:
    """A kernel stage's activity (Ray tasks over shards of histories, on the CPU or a GPU): the resolved
    ``retrieval.device`` keys its output and goes to ``run`` in ``params["device"]``."""
    device = kernel_device(ctx, ctx.cfg.retrieval.device)
    return Active(resolved={"device": device}, params={"device": device})


def shard_units(ctx: StageContext, history_ids: list[str]) -> list[dict[str, Any]]:
    """Units of ``ray.shard_size`` histories of ``history_ids`` (sorted)."""
    return [{"size": len(ids), "histories": ids} for ids in chunk(sorted(set(history_ids)), ctx.cfg.ray.shard_size)]


def segment_units(chains: dict[str, list[str]], covered: dict[str, int],
                  pieces: Callable[[str, int, int], list[tuple[int, int]]], shard_size: int) -> list[dict[str, Any]]:
    """Units of new segments (associate, card-graph-associate): each history's sessions from the end of its
    current segments (``covered``) to its last one, cut by ``pieces(history, a, s)``; a history of one piece
    shares a unit with ``shard_size`` - 1 others, a longer one gives a unit per piece. A segment is
    ``[history, first session, end session, the chain's digest at the end]``."""
    small: list[list[Any]] = []
    large: list[list[list[Any]]] = []
    for h in sorted(chains):
        c = chains[h]
        a, s = covered.get(h, 0), len(c) - 1
        if a >= s:
            continue
        segs = [[h, x, y, c[y]] for x, y in pieces(h, a, s)]
        if len(segs) == 1:
            small.append(segs[0])
        else:
            large += [[seg] for seg in segs]
    return [{"size": len(g), "segments": g} for g in chunk(small, shard_size) + large]


def edge_tables(segs: Sequence[Sequence[Any]], per_mode: dict[str, list[Any]]) -> tuple[pa.Table, pa.Table]:
    """(edges, edge segments) of a unit: ``per_mode`` {mode: one ``Edges`` per segment, in ``segs``' order}."""
    from memgas.pipeline.schema import EDGE_SEGMENTS, EDGES

    cols: dict[str, list] = {"history_id": [], "src": [], "dst": [], "similarity": [], "mode": []}
    for mode, edges in per_mode.items():
        for (h, *_), e in zip(segs, edges):
            n = len(e.src)
            cols["history_id"] += [h] * n
            cols["src"] += e.src.tolist()
            cols["dst"] += e.dst.tolist()
            cols["similarity"] += e.sim.tolist()
            cols["mode"] += [mode] * n
    segments = pa.table([list(c) for c in zip(*segs)] if segs else [[] for _ in EDGE_SEGMENTS.names],
                        schema=EDGE_SEGMENTS)
    return pa.table(cols, schema=EDGES), segments
