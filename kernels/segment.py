"""Segment sums: aggregate per-node values into per-group values (e.g. nodes -> sessions)."""
from __future__ import annotations

from typing import Any


def segment_sum_contiguous(values: Any, group_size: int) -> Any:
    """Sum consecutive blocks of ``group_size`` along the last axis: [..., G*group_size] -> [..., G].

    MemGAS stores a session's 4 nodes contiguously (node = 4*session + g), so this is a reshape + sum.
    """
    n = values.shape[-1]
    if n % group_size:
        raise ValueError(f"last axis {n} is not a multiple of group_size {group_size}")
    return values.reshape(values.shape[:-1] + (n // group_size, group_size)).sum(axis=-1)
