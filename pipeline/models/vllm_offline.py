"""vLLM's offline engine (GPU): the keyword arguments it is given, checked against the pinned release by tests,
and :class:`VLLMOfflineLLM`."""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from memgas.pipeline.models.backend_common import item_error, lazy_import, truncate_messages_middle, validate_prompt
from memgas.pipeline.models.base import ChatPrompt, GenerationResult, SamplingParams

logger = logging.getLogger(__name__)


#: keyword arguments of every ``LLM.chat`` call (tests check them against the pinned vLLM's signature)
VLLM_CHAT_KWARGS: dict[str, Any] = {"use_tqdm": False}


def vllm_engine_kwargs(
    model: str,
    context_tokens: int = 8192,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.85,
    seed: int = 0,
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(...)``: named ``LLM.__init__`` parameters plus ``EngineArgs`` fields
    (``LLM`` forwards its ``**kwargs`` to ``EngineArgs``). Pure: tests check the names against the pinned
    vLLM release, and build a real ``EngineArgs`` from them where vLLM is installed."""
    return {
        "model": model,
        "tensor_parallel_size": tensor_parallel_size,
        "gpu_memory_utilization": gpu_memory_utilization,
        "enable_prefix_caching": True,  # summary/keyword/filter prompts share long instruction prefixes
        "max_model_len": context_tokens,
        "seed": seed,
        **engine_kwargs,
    }


def vllm_sampling_kwargs(params: SamplingParams, max_new: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(``vllm.SamplingParams`` kwargs without the structured-output object, ``StructuredOutputsParams``
    kwargs or None). Pure, so the names can be checked against the pinned vLLM without importing it."""
    kw: dict[str, Any] = {
        "max_tokens": max_new,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "seed": params.seed,
    }
    if any(params.stop):  # an empty stop string would match at once
        kw["stop"] = [x for x in params.stop if x]
    structured = {"json": params.json_schema} if params.json_schema is not None else None
    return kw, structured


def _vllm_sampling_params(vllm: Any, params: SamplingParams, max_new: int) -> Any:
    """vLLM ``SamplingParams``; JSON schemas go through ``StructuredOutputsParams(json=...)`` (vLLM >= 0.11;
    the older ``guided_decoding=GuidedDecodingParams(json=...)`` was removed in 0.12)."""
    kw, structured = vllm_sampling_kwargs(params, max_new)
    if structured is not None:
        sp_mod = importlib.import_module("vllm.sampling_params")
        if hasattr(sp_mod, "StructuredOutputsParams"):
            kw["structured_outputs"] = sp_mod.StructuredOutputsParams(**structured)
        elif hasattr(sp_mod, "GuidedDecodingParams"):
            kw["guided_decoding"] = sp_mod.GuidedDecodingParams(**structured)
        else:
            raise ImportError("this vLLM has neither StructuredOutputsParams nor GuidedDecodingParams")
    return vllm.SamplingParams(**kw)


class VLLMOfflineLLM:
    """vLLM's offline engine on GPU: the whole batch in one ``LLM.chat`` call, prefix caching on.

    GPU-only; not exercised on the CPU CI. Tests check every keyword we pass against the parameters of the
    pinned vLLM release (tests/fixtures/vllm_api.json) through a strict fake module, and build the real
    ``EngineArgs``/``SamplingParams`` where vLLM is installed; ``benchmarks/gpu_check.sh`` runs the engine.
    """

    def __init__(
        self,
        model: str,
        context_tokens: int = 8192,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        seed: int = 0,
        name: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self._vllm = lazy_import("vllm", "make setup-gpu (the gpu extra: vllm with its CUDA torch build)")
        self._llm = self._vllm.LLM(
            **vllm_engine_kwargs(model, context_tokens, tensor_parallel_size, gpu_memory_utilization, seed,
                                 **engine_kwargs)
        )
        self._tok = self._llm.get_tokenizer()
        self.context_tokens = context_tokens
        self.name = name or model
        #: vLLM V1 runs the model in an engine-core process unless VLLM_ENABLE_V1_MULTIPROCESSING=0: the actor's
        #: own torch allocator then holds almost none of its memory (executor.ModelHost.gpu_memory)
        self.engine_in_other_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"

    def count_tokens(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False))

    def count_prompt_tokens(self, messages: ChatPrompt) -> int:
        """Tokens of ``messages`` rendered with the chat template and the generation prompt, uncut."""
        return self._prompt_len(messages)

    def _prompt_len(self, msgs: ChatPrompt) -> int:
        ids = self._tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return len(ids)

    def generate(self, prompts: list[ChatPrompt], params: SamplingParams) -> list[GenerationResult]:
        results = [GenerationResult() for _ in prompts]
        max_new = max(1, min(params.max_tokens, self.context_tokens - 1))
        try:
            sp = _vllm_sampling_params(self._vllm, params, max_new)
        except Exception as exc:
            for r in results:
                r.error = f"{type(exc).__name__}: {exc}"
            return results
        todo: list[int] = []
        convs: list[ChatPrompt] = []
        for i, p in enumerate(prompts):
            err = validate_prompt(p)
            if err:
                results[i].error = err
                continue
            try:
                msgs, dropped = truncate_messages_middle(
                    p, self._prompt_len, lambda s: self._tok.encode(s, add_special_tokens=False),
                    self._tok.decode, self.context_tokens - max_new,
                )
            except Exception as exc:
                item_error(results[i], exc)
                continue
            if dropped:
                results[i].extra.update(truncated=True, dropped_tokens=dropped)
            todo.append(i)
            convs.append(msgs)
        if not convs:
            return results
        try:
            outs = self._llm.chat(convs, sp, **VLLM_CHAT_KWARGS)
            pairs = list(zip(todo, outs))
        except Exception as exc:  # one bad conversation can fail the batch: isolate it
            logger.warning("%s: batch of %d failed (%s); retrying one by one", self.name, len(convs), exc)
            pairs = []
            for i, c in zip(todo, convs):
                try:
                    pairs.append((i, self._llm.chat([c], sp, **VLLM_CHAT_KWARGS)[0]))
                except Exception as exc1:
                    results[i].error = f"{type(exc1).__name__}: {exc1}"
        for i, out in pairs:
            comp = out.outputs[0]
            r = results[i]
            r.text = comp.text
            r.finish_reason = comp.finish_reason or ""
            r.prompt_tokens = len(out.prompt_token_ids or [])
            r.completion_tokens = len(comp.token_ids or [])
        return results
