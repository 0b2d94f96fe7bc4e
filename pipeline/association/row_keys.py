"""Fixed keys of a history's node rows: the order in which the IVF search's recall sample takes them
(:func:`memgas.pipeline.association.ivf_search.recall_sample`)."""
from __future__ import annotations

import hashlib

import numpy as np

#: seed of the rows' keys (with the history and the node id: the same sample on every run and machine)
RECALL_SEED = 29

#: splitmix64's increment and finaliser multipliers (Steele, Lea and Flood 2014; Vigna's reference code)
_GAMMA, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def row_keys(history_id: str, rows: np.ndarray) -> np.ndarray:
    """A fixed uint64 key per node row (id) of one history, which orders its rows for the recall sample.

    ``splitmix64(base + (row + 1) * GAMMA)`` mod 2**64, ``base`` = blake2b of the history id keyed by
    :data:`RECALL_SEED`: a row's key depends on nothing but (seed, history, row), so it is the same in every
    unit, cut, run and machine (integer arithmetic only), and vectorised (a unit may hold 655,360 rows). The
    step is odd and the finaliser a bijection on 64 bits, so the rows of one history have distinct keys:
    the bottom-k is one set, with no ties to break."""
    h = hashlib.blake2b(history_id.encode(), digest_size=8, key=RECALL_SEED.to_bytes(8, "little")).digest()
    x = np.uint64(int.from_bytes(h, "little")) + (np.asarray(rows, np.uint64) + np.uint64(1)) * _GAMMA
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def bottom_k(keys: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` smallest ``keys`` (all when fewer), smallest first (ties by position)."""
    keys = np.asarray(keys, np.uint64)
    if keys.size <= k:
        return np.argsort(keys, kind="stable")
    part = np.argpartition(keys, k - 1)[:k] if k > 0 else np.zeros(0, np.int64)
    return part[np.lexsort((part, keys[part]))]
