"""Shared fixtures for the pipeline tests.

The real models are loaded once per test session (not once per module): SmolLM2 through
``TransformersLLM`` and MiniLM through ``SentenceTransformerEncoder``. Tests must not change their
settings; wrap them (see the counting wrappers in the test modules) to observe calls.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest
from memgas.pipeline.bank import Bank
from memgas.pipeline.hashing import text_hash


@pytest.fixture(scope="session")
def smollm():
    """The real SmolLM2 (GGUF through transformers), CPU, 2048-token context."""
    from memgas.pipeline.models.llms import TransformersLLM

    # float32: the GGUF kernels compute in float32 anyway; bf16 only adds casts on CPU
    return TransformersLLM("smollm2", context_tokens=2048, dtype="float32")


@pytest.fixture(scope="session")
def encoder():
    """The real MiniLM sentence encoder on CPU with default options (truncate, batch 64)."""
    from memgas.pipeline.models.encoders import SentenceTransformerEncoder

    return SentenceTransformerEncoder("minilm", device="cpu")


# Sessions of the small bank: h1 = sessions a, b; h2 = b, c (b shared: stored, generated and embedded once).
SESS = {
    "a": ["user: I adopted a cat.", "assistant: Nice!", "user: Her name is Miso.", "assistant: Lovely name."],
    "b": ["user: Wedding in Lisbon.", "assistant: In June?"],
    "c": ["user: Only one utterance here."],
}


def _make_bank(tmp_path: Path) -> Bank:
    """h1 = sessions a, b; h2 = b, c (b shared: stored, generated and embedded once)."""
    bank = Bank.create(tmp_path / "bank")
    texts, pairs, sessions = {}, [], []
    for key, utt in SESS.items():
        st = "\n".join(utt)
        texts[text_hash(st)] = st
        for j in range(0, len(utt), 2):
            pt = "\n".join(utt[j : j + 2])
            texts[text_hash(pt)] = pt
            pairs.append({"session_hash": text_hash(st), "pair_index": j // 2, "text_hash": text_hash(pt),
                          "has_answer": None, "dia_ids": None})
    for hid, keys in (("h1", "ab"), ("h2", "bc")):
        for pos, k in enumerate(keys):
            sessions.append({"history_id": hid, "session_id": f"{hid}-{k}", "position": pos, "date_raw": None,
                             "date": None, "text_hash": text_hash("\n".join(SESS[k])), "n_turns": len(SESS[k]),
                             "dataset_summary": None})
    bank.write("sessions", pa.Table.from_pylist(sessions))
    bank.write("texts", pa.Table.from_pylist([{"text_hash": h, "text": t} for h, t in sorted(texts.items())]))
    bank.write("pairs", pa.Table.from_pylist(pairs))
    return bank


@pytest.fixture(scope="session")
def make_bank() -> Callable[[Path], Bank]:
    """``make_bank(tmp_path)`` builds the small three-session bank (sessions, texts, pairs) under tmp_path."""
    return _make_bank


def run_stage_in_process(bank: Bank, cfg, name: str, model=None, results: Bank | None = None) -> tuple[dict, object]:
    """Run the production stage ``name`` (plan, inputs, run, finish, marker) in-process on ``bank``.

    ``model``: an already loaded (e.g. wrapped) model the stage's worker uses instead of loading its own.
    Returns (the run-record entry, the stage context).
    """
    from memgas.jobs import runner, tables
    from memgas.jobs.executor import use_loaded_model
    from memgas.jobs.placement import placement, resolve_stage_runtimes
    from memgas.jobs.profiling import Profiler
    from memgas.jobs.stage import StageContext

    ctx = StageContext(cfg, bank, results, use_ray=False)
    resolve_stage_runtimes(ctx)
    runner.compute_fingerprints(ctx)
    stage = next(s for s in ctx.pipeline if s.name == name)
    active = stage.active(ctx)
    if model is not None:
        use_loaded_model(stage.model, placement(stage, active, ctx).config, model)
    entry = runner.run_stage(stage, ctx, active, tables.store_of(ctx, stage), ctx.fingerprints[name], Profiler(), {})
    return entry, ctx


@pytest.fixture(scope="session")
def run_stage():
    return run_stage_in_process
