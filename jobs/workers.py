"""Model workers: objects that load a model once and process large batches of unique texts.

They run inside Ray actors (see :func:`memgas.jobs.executor.run_actor_units`) or in-process with
``--no-ray``. Payloads and results are plain lists / Arrow tables, never Python object graphs.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np
import pyarrow as pa

from memgas.pipeline.config import EncoderConfig, GenerationConfig, LLMConfig, ReadingConfig
from memgas.pipeline.schema import embeddings_schema

log = logging.getLogger(__name__)


def _threads(n: int | None) -> None:
    # Ray sets OMP_NUM_THREADS=1 in workers with num_cpus=1; a model worker owns its cores, so undo that.
    import torch

    n = n or os.cpu_count() or 1
    torch.set_num_threads(max(1, n))


class EncodeWorker:
    def __init__(self, config: dict[str, Any]) -> None:
        from memgas.pipeline.models.factory import make_encoder

        _threads(config.get("threads"))
        self.encoder = make_encoder(EncoderConfig(**config["encoder"]))

    def encode(self, payload: dict[str, Any]) -> pa.Table:
        from memgas.pipeline.encode import encode_texts

        hashes, texts = payload["hashes"], payload["texts"]
        t0 = time.perf_counter()
        vecs, truncated = encode_texts(self.encoder, texts)
        vecs = np.ascontiguousarray(vecs, dtype=np.float32)
        dim = vecs.shape[1]
        flat = pa.array(vecs.reshape(-1), pa.float32())
        table = pa.table(
            {
                "text_hash": pa.array(hashes, pa.string()),
                "encoder": pa.array([self.encoder.name] * len(hashes), pa.string()),
                "vector": pa.FixedSizeListArray.from_arrays(flat, dim),
                "truncated": pa.array(np.asarray(truncated, dtype=bool)),
            },
            schema=embeddings_schema(dim),
        )
        log.debug("encoded %d texts in %.2fs", len(texts), time.perf_counter() - t0)
        return table


def make_encode_worker(config: dict[str, Any]) -> EncodeWorker:
    return EncodeWorker(config)


class GenerationWorker:
    """Summary + keywords for unique sessions (LLM, LLM-free, or LLM with LLM-free fallback)."""

    def __init__(self, config: dict[str, Any]) -> None:
        from memgas.pipeline.models.factory import make_encoder, make_llm

        _threads(config.get("threads"))
        self.gen_cfg = GenerationConfig(**config["generation"])
        self.llm = None
        if self.gen_cfg.generator != "llm-free":
            self.llm = make_llm(LLMConfig(**config["llm"]))
        # the LLM-free generator ranks sentences by embedding: it needs the encoder
        self.encoder = make_encoder(EncoderConfig(**config["encoder"])) if self.gen_cfg.generator != "llm" else None

    def generate(self, payload: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.generate import derived_texts, generate_for_sessions

        items = [tuple(i) for i in payload["items"]]
        gens = generate_for_sessions(items, self.llm, self.gen_cfg, encoder=self.encoder)
        # summaries, keywords and the hybrid text become texts of their own, to be encoded
        return {"generations": gens, "texts": derived_texts(gens, {i[0]: i[1] for i in items})}


def make_generation_worker(config: dict[str, Any]) -> GenerationWorker:
    return GenerationWorker(config)


class ReadWorker:
    """Filter + answer over retrieved sessions (one LLM load per worker)."""

    def __init__(self, config: dict[str, Any]) -> None:
        from memgas.pipeline.models.factory import make_llm

        _threads(config.get("threads"))
        self.llm = make_llm(LLMConfig(**config["llm"]))
        self.cfg = ReadingConfig(**config["reading"])

    def answer(self, payload: dict[str, Any]) -> pa.Table:
        from memgas.pipeline.read import read_and_answer

        return read_and_answer(payload["queries"], self.llm, self.cfg, method=payload["method"])

    def judge(self, payload: dict[str, Any]) -> pa.Table:
        import pandas as pd

        from memgas.pipeline.evaluate.judge import run_judge

        df = run_judge(self.llm, pd.DataFrame(payload["rows"]))
        return pa.Table.from_pandas(df, preserve_index=False)


def make_read_worker(config: dict[str, Any]) -> ReadWorker:
    return ReadWorker(config)
