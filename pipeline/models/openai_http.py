"""OpenAI-compatible chat-completions client (vLLM serve, llama.cpp server, hosted APIs).

``httpx.AsyncClient`` with bounded concurrency (a semaphore), a per-request timeout, and retries with
exponential backoff and seeded jitter on 429, 5xx, timeouts and connection errors. ``timeout_s`` bounds each
attempt whole (connect, send and the entire response), so a server trickling an endless body is a timeout, and
a body over ``MAX_RESPONSE_BYTES`` is a failure retried like a dropped connection. Every failure ends up in
its item's ``GenerationResult.error``; the batch never raises. The API key is read from the environment
variable named in the config, sent as a Bearer header, and never logged or shown in ``repr``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import threading
from typing import Any, Callable

import httpx

from memgas.pipeline.models.base import ChatPrompt, GenerationResult, SamplingParams
from memgas.pipeline.models.llms import PROMPT_TOO_LONG, PromptTooLong, truncate_messages_middle, validate_prompt
from memgas.pipeline.redact import redact

logger = logging.getLogger(__name__)

#: Largest response body read (bytes after any Content-Encoding is undone). A completion of a few thousand
#: tokens is tens of KB of JSON, even with every character escaped as ``\\uXXXX``; a body past this is a
#: broken or hostile server, and reading it whole would hold the worker's memory for nothing. Such a body is
#: a counted, retried failure, like a dropped connection.
MAX_RESPONSE_BYTES = 4 << 20

_RETRY_STATUS = {408, 409, 425, 429}


class ResponseTooLarge(Exception):
    """The server's response body passed MAX_RESPONSE_BYTES (retried like a transport failure)."""


def _retryable_status(code: int) -> bool:
    return code in _RETRY_STATUS or code >= 500


def approx_tokens(text: str) -> int:
    """~4 characters per token for English BPE vocabularies; only used to keep prompts under the context
    when no tokenizer is given (the server has the real one and rejects what does not fit)."""
    return math.ceil(len(text) / 4)


class OpenAIHTTPLLM:
    """Chat completions over HTTP. ``base_url`` includes the API prefix, e.g. ``http://host:8000/v1``."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        concurrency: int = 8,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        context_tokens: int = 8192,
        seed: int = 0,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        count_tokens_fn: Callable[[str], int] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not base_url:
            raise ValueError("openai backend: llm.base_url is required (e.g. http://localhost:8000/v1)")
        self.base_url = base_url.rstrip("/")
        # what logs, errors and repr show: ``http://user:pass@host`` is a credential (this client runs in Ray
        # actors, whose log lines reach the driver's terminal without passing through the CLI's formatter)
        self.shown_url = redact(self.base_url)
        self.model = model
        self.name = model
        self.context_tokens = context_tokens
        self.concurrency = max(1, concurrency)
        self.timeout_s = timeout_s
        self.max_retries = max(0, max_retries)
        self.seed = seed
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.api_key_env = api_key_env
        # Read once; kept private and out of repr/logs. An unset variable means "no auth" (local servers).
        self.__api_key = _Secret(os.environ.get(api_key_env) or "")
        self._count = count_tokens_fn or approx_tokens
        self._transport = transport

    def __repr__(self) -> str:
        key = "set" if self.__api_key else "unset"
        return (
            f"OpenAIHTTPLLM(base_url={self.shown_url!r}, model={self.model!r}, concurrency={self.concurrency}, "
            f"timeout_s={self.timeout_s}, max_retries={self.max_retries}, api_key=<{key} via ${self.api_key_env}>)"
        )

    def count_tokens(self, text: str) -> int:
        return self._count(text)

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.__api_key:
            h["Authorization"] = f"Bearer {self.__api_key.reveal()}"
        return h

    def _body(self, messages: ChatPrompt, params: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": params.seed,
        }
        if params.stop:
            body["stop"] = list(params.stop)
        if params.json_schema is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": params.json_schema, "strict": True},
            }
        return body

    # -- sync entry point --------------------------------------------------------------------------------
    def generate(self, prompts: list[ChatPrompt], params: SamplingParams) -> list[GenerationResult]:
        """Blocking wrapper. Runs its own event loop; if the calling thread already runs one (a notebook,
        an async job), the loop runs in a helper thread so we never nest loops."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.agenerate(prompts, params))
        box: dict[str, Any] = {}

        def runner() -> None:
            try:
                box["out"] = asyncio.run(self.agenerate(prompts, params))
            except BaseException as exc:  # surfaced in the caller's thread below
                box["exc"] = exc

        t = threading.Thread(target=runner, name="openai-http-generate")
        t.start()
        t.join()
        if "exc" in box:
            raise box["exc"]
        return box["out"]

    async def agenerate(self, prompts: list[ChatPrompt], params: SamplingParams) -> list[GenerationResult]:
        sem = asyncio.Semaphore(self.concurrency)
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeout_s), limits=limits, transport=self._transport
        ) as client:
            tasks = [self._one(client, sem, i, p, params) for i, p in enumerate(prompts)]
            return list(await asyncio.gather(*tasks))

    async def _one(
        self, client: httpx.AsyncClient, sem: asyncio.Semaphore, index: int, prompt: ChatPrompt,
        params: SamplingParams,
    ) -> GenerationResult:
        try:
            return await self._one_inner(client, sem, index, prompt, params)
        except Exception as exc:  # anything unforeseen fails this item only, never the gather()
            logger.warning("item %d failed: %s", index, type(exc).__name__)
            return GenerationResult(error=redact(f"{type(exc).__name__}: {exc}"))

    async def _one_inner(
        self, client: httpx.AsyncClient, sem: asyncio.Semaphore, index: int, prompt: ChatPrompt,
        params: SamplingParams,
    ) -> GenerationResult:
        r = GenerationResult()
        err = validate_prompt(prompt)
        if err:
            r.error = err
            return r
        budget = max(1, self.context_tokens - params.max_tokens)
        try:
            msgs, dropped = truncate_messages_middle(
                prompt,
                lambda m: sum(self._count(x.get("content") or "") + 8 for x in m),
                _CharCodec.encode,
                _CharCodec.decode,
                budget,
            )
        except ValueError as exc:
            r.error = str(exc)
            if isinstance(exc, PromptTooLong):
                r.extra[PROMPT_TOO_LONG] = True
            return r
        if dropped:
            r.extra.update(truncated=True, dropped_tokens=dropped)
        body = self._body(msgs, params)
        url = f"{self.base_url}/chat/completions"
        shown = f"{self.shown_url}/chat/completions"
        # Seeded per item so a re-run waits the same way; jitter spreads retries of a batch apart.
        rng = random.Random(self.seed * 1_000_003 + index)
        attempt = 0
        async with sem:
            while True:
                retry_after: float | None = None
                try:
                    # httpx's timeout bounds each read, not the response: a byte every few seconds never trips it
                    status, headers, content = await asyncio.wait_for(self._post(client, url, body), self.timeout_s)
                except (httpx.TimeoutException, httpx.TransportError, ResponseTooLarge) as exc:
                    reason = redact(f"{type(exc).__name__}: {exc or 'no detail'}")  # httpx may quote the URL
                except TimeoutError:
                    reason = f"TimeoutError: no complete response within {self.timeout_s:g} s"
                else:
                    if status == 200:
                        return self._parse(content, r, attempt)
                    reason = f"HTTP {status}: {content.decode('utf-8', 'replace')[:300]}"
                    if not _retryable_status(status):
                        r.error, r.retries = reason, attempt
                        if status == 400 and _error_code(content) == "context_length_exceeded":
                            # the server counted the prompt with its own tokenizer (this client only estimates
                            # 4 characters a token): the same prompt can never fit, as a local backend's PromptTooLong
                            r.extra[PROMPT_TOO_LONG] = True
                        return r
                    retry_after = _retry_after(headers)
                if attempt >= self.max_retries:
                    r.error = f"{reason} (after {attempt} retries)"
                    r.retries = attempt
                    logger.warning("%s item %d failed: %s", shown, index, r.error)
                    return r
                delay = min(self.backoff_max_s, self.backoff_base_s * (2**attempt)) * (0.5 + rng.random())
                if retry_after is not None:
                    delay = max(delay, min(retry_after, self.backoff_max_s))
                logger.info("%s item %d: %s; retry %d in %.2fs", shown, index, reason, attempt + 1, delay)
                await asyncio.sleep(delay)
                attempt += 1

    async def _post(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[int, httpx.Headers, bytes]:
        """One request: status, headers and the body, read in chunks and given up past MAX_RESPONSE_BYTES
        (ResponseTooLarge) without reading the rest."""
        async with client.stream("POST", url, json=body, headers=self._headers()) as resp:
            chunks, size = [], 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > MAX_RESPONSE_BYTES:
                    raise ResponseTooLarge(f"the response body is larger than the limit of {MAX_RESPONSE_BYTES} bytes")
                chunks.append(chunk)
            return resp.status_code, resp.headers, b"".join(chunks)

    def _parse(self, raw: bytes, r: GenerationResult, attempt: int) -> GenerationResult:
        """The item's text, finish reason and usage from a 200 body, or its malformed-response error: a body
        whose values are of the wrong type or out of range is the server's fault, never stored (a usage of 10^30
        tokens overflowed the Parquet write and ended the run)."""
        r.retries = attempt
        try:
            data = json.loads(raw)
            choice = data["choices"][0]
            text = _text_or_null(choice["message"].get("content"), "choices[0].message.content")
            finish = _text_or_null(choice.get("finish_reason"), "choices[0].finish_reason")
            usage = data.get("usage") or {}
            prompt_tokens = _token_count(usage, "prompt_tokens")
            completion_tokens = _token_count(usage, "completion_tokens")
        except (json.JSONDecodeError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            r.text = ""
            r.error = f"malformed response ({type(exc).__name__}: {exc}): {raw[:200].decode('utf-8', 'replace')!r}"
            return r
        r.text, r.finish_reason = text, finish
        r.prompt_tokens, r.completion_tokens = prompt_tokens, completion_tokens
        return r


def _error_code(raw: bytes) -> str | None:
    """OpenAI's ``error.code`` of an error body, or None when the body is not such an object."""
    try:
        code = json.loads(raw)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


#: Largest token count a response's usage may report (far above any context; counts are stored as int64).
MAX_USAGE_TOKENS = 2**31 - 1


def _text_or_null(v: Any, where: str) -> str:
    """A string field of the response; null (no text: a refusal, a tool call) is the empty string."""
    if v is None:
        return ""
    if not isinstance(v, str):
        raise ValueError(f"{where} is a {type(v).__name__}, not text or null")
    return v


def _token_count(usage: Any, key: str) -> int:
    """``usage[key]``: a whole number of tokens in [0, MAX_USAGE_TOKENS] (a whole-number float is taken; missing
    or null is 0)."""
    v = usage.get(key)
    if v is None:
        return 0
    if isinstance(v, float) and v.is_integer() and 0 <= v <= MAX_USAGE_TOKENS:
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_USAGE_TOKENS:
        raise ValueError(f"usage.{key} {v!r} is not a token count")
    return v


class _Secret:
    """Holds the API key so that repr/str/vars()/logging of the client never print it."""

    __slots__ = ("_v",)

    def __init__(self, value: str) -> None:
        self._v = value

    def reveal(self) -> str:
        return self._v

    def __bool__(self) -> bool:
        return bool(self._v)

    def __repr__(self) -> str:
        return "<secret>" if self._v else "<unset>"

    __str__ = __repr__


def _retry_after(headers: httpx.Headers) -> float | None:
    v = headers.get("retry-after")
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None


class _CharCodec:
    """Without the server's tokenizer, truncation works on characters: one pseudo-token = 4 characters
    (as in :func:`approx_tokens`), packed losslessly into one int (21 bits per code point)."""

    @staticmethod
    def encode(s: str) -> list[int]:
        out = []
        for k in range(0, len(s), 4):
            v = 0
            for j, ch in enumerate(s[k : k + 4]):
                v |= (ord(ch) + 1) << (21 * j)  # +1 so that a NUL character is not mistaken for "no char"
            out.append(v)
        return out

    @staticmethod
    def decode(ids: list[int]) -> str:
        chars = []
        for v in ids:
            while v:
                chars.append(chr((v & 0x1FFFFF) - 1))
                v >>= 21
        return "".join(chars)
