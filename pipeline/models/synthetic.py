"""The synthetic encoder (``encoder.model: synthetic``): a vector per text from the text's hash, no model.

For scale runs only: it lets a whole split pass through every stage of the job at the speed of hashing, so
that what the job itself costs (ingest, plans, markers, association, search, evaluation) can be measured
without the encoder's hours. Its vectors carry nothing of the text's meaning, so every retrieval or QA
number of a run with it measures nothing: metrics.json (``synthetic_encoder``), report.md and the bank's
manifest say so, and ``benchmarks/headline.py`` refuses such a run.

A vector is a pure function of the text and the dimension: SHAKE-128 of a tag, the dimension and the text's
UTF-8 bytes gives ``dim`` signed 16-bit integers; their sum of squares is exact in float64 (below 2^53), so
the square root, the division and the cast to float32 are correctly rounded IEEE operations and the bits
are the same on every machine, whatever the batch size, the worker or the process (Ray or not).
"""

from __future__ import annotations

import hashlib

import numpy as np

#: the ``encoder.model`` value that selects this encoder (reserved: a local model folder of that name is
#: given as a path, ``./synthetic``)
SYNTHETIC_MODEL = "synthetic"
#: MiniLM's dimension, so a scale run's vectors take the disk and memory the default encoder's would
SYNTHETIC_DIM = 384
#: version of the recipe (in the name, which keys the embeddings): a new recipe never mixes with old vectors
SYNTHETIC_VERSION = "shake128-int16-v1"
#: what every report of a run with this encoder says about its numbers
SYNTHETIC_NOTE = ("encoder.model=synthetic: vectors come from each text's hash, not from a model; every retrieval "
                  "and QA number of this run is meaningless (a scale run: only times, memory and counts mean "
                  "something)")


def is_synthetic(model: str) -> bool:
    """Whether ``encoder.model`` names the synthetic encoder."""
    return model == SYNTHETIC_MODEL


def manifest_entry(model: str) -> dict[str, object]:
    """What a bank's manifest says of the encoder behind a key of its ``embeddings`` (``encoders``)."""
    return {"model": model, "synthetic": True, "note": SYNTHETIC_NOTE} if is_synthetic(model) else {"model": model}


def synthetic_vectors(texts: list[str], dim: int = SYNTHETIC_DIM) -> np.ndarray:
    """float32 ``[len(texts), dim]`` unit vectors, each a function of its text and ``dim`` alone."""
    if dim < 1:
        raise ValueError(f"dim={dim}: expected >= 1")
    tag = f"memgas-synthetic|{SYNTHETIC_VERSION}|{dim}|".encode()
    raw = b"".join(hashlib.shake_128(tag + t.encode("utf-8", "surrogatepass")).digest(2 * dim) for t in texts)
    ints = np.frombuffer(raw, dtype="<i2").reshape(len(texts), dim).astype(np.float64)
    norm = np.sqrt((ints * ints).sum(axis=1, keepdims=True))  # exact sums: integers below 2^53
    zero = norm[:, 0] == 0  # all-zero digest (probability 2^-(16*dim)): a fixed unit vector
    ints[zero, 0], norm[zero] = 1.0, 1.0
    return (ints / norm).astype(np.float32)


class SyntheticEncoder:
    """The :class:`~memgas.pipeline.models.base.Encoder` of ``encoder.model: synthetic``. No truncation (the
    whole text is hashed) and no token counts (there is no tokenizer: ``last_tokens`` is None, so the
    ``embeddings`` rows leave ``tokens`` null rather than guess)."""

    normalize = True

    def __init__(self, dim: int = SYNTHETIC_DIM, max_tokens: int | None = None) -> None:
        self.dim = int(dim)
        #: the window the job plans with; the vectors do not depend on it (nothing is cut)
        self.max_tokens = int(max_tokens or 512)
        self.name = f"{SYNTHETIC_MODEL}:{SYNTHETIC_VERSION}|dim{self.dim}"
        self.last_truncated: np.ndarray = np.zeros(0, dtype=bool)
        self.last_tokens: np.ndarray | None = None
        self.last_tokens_dropped: np.ndarray | None = None

    def encode(self, texts: list[str]) -> np.ndarray:
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"encode: texts[{bad}] is {type(texts[bad]).__name__}, expected str")
        self.last_truncated = np.zeros(len(texts), dtype=bool)
        return synthetic_vectors(list(texts), self.dim)

    def with_max_tokens(self, max_tokens: int | None) -> SyntheticEncoder:
        """This encoder: a window changes no synthetic vector (the job keys windows apart all the same)."""
        return self

    def __repr__(self) -> str:
        return f"SyntheticEncoder(name={self.name!r}, dim={self.dim})"
