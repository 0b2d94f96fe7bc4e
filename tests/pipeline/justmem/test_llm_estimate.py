"""JustMem's LLM extractor on a CPU backend takes minutes per session: before it starts, the run says how long,
in one line (the cards stage, once it knows how many sessions are left), when that is more than a few minutes.
Nothing is said for the LLM-free extractor, an LLM off this machine's CPU, or a short extraction."""

from __future__ import annotations

import logging

import pytest

from memgas.jobs.placement import resolve_stage_runtimes
from memgas.pipeline.justmem.llm_estimate import CPU_LLM_SECONDS_PER_TOKEN, SAY_ESTIMATE_ABOVE_S, llm_extractor_estimate
from memgas.jobs.stage import StageContext
from memgas.jobs.stages.cards import CardsStage
from memgas.pipeline.config import MemgasConfig

from .conftest import REPO


def _cfg(*sets: str) -> MemgasConfig:
    return MemgasConfig.load(REPO / "configs" / "demo.yaml", list(sets))


def test_the_cards_stage_says_how_long_the_cpu_llm_extractor_will_take(locomo_bank, caplog) -> None:
    cfg = _cfg("justmem.extractor=llm", "llm.backend=transformers-gguf")
    ctx = StageContext(cfg, locomo_bank, None, use_ray=False)
    resolve_stage_runtimes(ctx)
    ctx.resolved["llm"] = {"device": "cpu", "dtype": "float32"}  # as on a machine without a GPU
    with caplog.at_level(logging.WARNING, logger="memgas.jobs.stages.cards"):
        units = CardsStage().plan(ctx)
    sessions = sum(u["size"] for u in units)
    seconds = sessions * cfg.justmem.extract_max_tokens * CPU_LLM_SECONDS_PER_TOKEN
    assert sessions == 38 and seconds / 3600 == pytest.approx(23.8, abs=0.05)
    assert [r.getMessage() for r in caplog.records] == [
        f"cards: the LLM extractor (transformers-gguf smollm2 on CPU) will take about 23.8 h for 38 sessions on this "
        f"machine (1024 output tokens each at {CPU_LLM_SECONDS_PER_TOKEN} s per token, docs/models.md): on CPU it is "
        "a correctness check; justmem.extractor=llm-free takes seconds, an LLM on a GPU (llm.backend=vllm) minutes"]


def test_nothing_is_said_for_the_llm_free_extractor_a_gpu_llm_or_a_short_extraction() -> None:
    llm = _cfg("justmem.extractor=llm")
    assert llm_extractor_estimate(_cfg(), "cpu", 38) is None  # the default: LLM-free
    assert llm_extractor_estimate(llm, "cuda", 38) is None
    assert llm_extractor_estimate(_cfg("justmem.extractor=llm", "llm.backend=openai", "llm.base_url=http://x"),
                                  "cpu", 38) is None
    few = int(SAY_ESTIMATE_ABOVE_S // (llm.justmem.extract_max_tokens * CPU_LLM_SECONDS_PER_TOKEN))
    assert llm_extractor_estimate(llm, "cpu", few) is None and llm_extractor_estimate(llm, "cpu", few + 1)
    other = llm_extractor_estimate(_cfg("justmem.extractor=llm", "llm.backend=hf", "llm.model=some/bigger-model",
                                        "justmem.extract_max_tokens=256"), "cpu", 10)
    assert other is not None and " will take at least 1.6 h for 10 sessions " in other
