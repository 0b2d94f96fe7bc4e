"""What the kernel stages over shards of histories (associate, rank, the card-graph stages) share: their
activity, their units and the node matrices they read."""

from __future__ import annotations

from typing import Any

import numpy as np
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
