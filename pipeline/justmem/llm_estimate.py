"""How long JustMem's LLM extractor will take on this machine's CPU, said before it starts (the bundled CPU LLM
is a correctness check there: docs/models.md, "JustMem's LLM extractor on CPU")."""

from __future__ import annotations

from memgas.pipeline.config import MemgasConfig

#: Seconds per generated token of the bundled CPU LLM (SmolLM2-135M-Instruct GGUF on the transformers backend,
#: float32, the JSON schema enforced while decoding) on an extraction prompt, as measured in docs/models.md
#: ("JustMem's LLM extractor on CPU") on a 2-core, 24 GiB machine at load average about 15.
CPU_LLM_SECONDS_PER_TOKEN = 2.2
#: The LLM backends that compute on this machine's CPU (the rate above applies to them)
CPU_LLM_BACKENDS = ("transformers-gguf", "hf", "llama-cpp")
#: An extraction estimated to take longer than this is said before it starts
SAY_ESTIMATE_ABOVE_S = 300.0


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def llm_extractor_estimate(cfg: MemgasConfig, llm_device: str | None, sessions: int) -> str | None:
    """The line a run logs before JustMem's LLM extractor starts on ``sessions`` sessions, when it runs on this
    machine's CPU and is estimated to take more than ``SAY_ESTIMATE_ABOVE_S``; None otherwise. The estimate:
    sessions x ``justmem.extract_max_tokens`` (a reply the schema budgets up to that many tokens, and a small
    model's reply mostly runs to the budget) x ``CPU_LLM_SECONDS_PER_TOKEN``; a repair call adds up to as much
    again. A model other than the bundled one (bigger, so slower) makes it a lower bound."""
    llm = cfg.llm
    if cfg.justmem.extractor != "llm" or llm.backend not in CPU_LLM_BACKENDS or llm_device != "cpu" or sessions <= 0:
        return None
    seconds = sessions * cfg.justmem.extract_max_tokens * CPU_LLM_SECONDS_PER_TOKEN
    if seconds <= SAY_ESTIMATE_ABOVE_S:
        return None
    about = "about" if llm.model == "smollm2" else "at least"
    return (f"cards: the LLM extractor ({llm.backend} {llm.model} on CPU) will take {about} {_duration(seconds)}"
            f" for {sessions} sessions on this machine ({cfg.justmem.extract_max_tokens} output "
            f"tokens each at {CPU_LLM_SECONDS_PER_TOKEN} s per token, docs/models.md): on CPU it is a correctness "
            "check; justmem.extractor=llm-free takes seconds, an LLM on a GPU (llm.backend=vllm) minutes")
