"""Units of work: chunking a stage's items into units, retry attempts in part names (the
parts themselves are named by :func:`memgas.jobs.tables.name_units`)."""

from __future__ import annotations

import re
from typing import Any


def chunk(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), max(1, size))]


def even_chunks(items: list[Any], size: int) -> list[list[Any]]:
    """As many consecutive chunks as ``chunk`` makes (at most ``size`` items each), of equal sizes: 38
    sessions in units of 32 become 19 + 19, not 32 + 6 (which left one of two actors idle)."""
    n = -(-len(items) // max(1, size))
    return chunk(items, -(-len(items) // n)) if n else []


def cost_chunks(items: list[Any], costs: list[float], size: int) -> list[list[Any]]:
    """As many consecutive chunks as ``chunk`` makes by count, cut where the running cost crosses equal
    shares of the total, so that units of very different texts take about equal time; a chunk of many
    cheap items may hold up to ``2 * size`` of them. (The demo's 857 texts in two 512-text units were 58k
    and 8k tokens on two actors; cutting them into more, smaller units instead pads each encoder batch to
    its longest text and was slower still.)"""
    n = -(-len(items) // max(1, size))
    if n <= 1:
        return [list(items)] if items else []
    share = sum(costs) / n
    out: list[list[Any]] = []
    cur: list[Any] = []
    acc = 0.0
    for item, c in zip(items, costs):
        cur.append(item)
        acc += c
        if len(cur) == 2 * size or (acc >= share * (len(out) + 1) and len(out) < n - 1):
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def attempt_of(part: str) -> int:
    """The retry attempt a read part belongs to (``...-<method>-a0003-00001-<digest>``)."""
    found = re.search(r"-a(\d+)-\d{5}(?:-|$)", part)
    return int(found.group(1)) if found else 0
