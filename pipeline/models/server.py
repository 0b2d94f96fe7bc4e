"""A small OpenAI-compatible chat-completions server over any memgas LLM backend.

Endpoints: ``POST /v1/chat/completions`` (model, messages, max_tokens / max_completion_tokens,
temperature, top_p, stop, seed, response_format), ``GET /v1/models``, ``GET /health``.
Invalid requests get HTTP 400 with an OpenAI-style error body naming the parameter (``stream: true``
included: completions are answered whole, never streamed), bodies over ``MAX_BODY_BYTES`` 413, and a body
shorter than its Content-Length a 400 after ``BODY_TIMEOUT_S``.
One request at a time reaches the model (a lock; batch size 1): this is for tests, demos and sharing one
CPU model between processes, not for throughput (use ``vllm serve`` for that).

Fault injection, for testing clients: ``delay_s`` before answering, the next N requests answer 500 / 429,
or the next N answer malformed JSON. Knobs are on ``server.faults`` and can be changed while it runs.

    python -m memgas.pipeline.models.server --port 8011                  # SmolLM2 (CPU default)
    python -m memgas.pipeline.models.server --port 8011 --backend echo --fail-500 2
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from memgas.pipeline.models.base import LLM, ChatPrompt, GenerationResult, SamplingParams

logger = logging.getLogger(__name__)


class EchoLLM:
    """Tiny deterministic LLM for tests: answers with the last message's words, cut to ``max_tokens``
    words (one word = one token). ``context_tokens`` bounds the prompt like a real model's."""

    def __init__(self, name: str = "echo", context_tokens: int = 4096) -> None:
        self.name = name
        self.context_tokens = context_tokens

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def generate(self, prompts: list[ChatPrompt], params: SamplingParams) -> list[GenerationResult]:
        out = []
        for p in prompts:
            if not p:
                out.append(GenerationResult(error="empty prompt"))
                continue
            words = str(p[-1].get("content", "")).split()
            text = " ".join(words[: params.max_tokens])
            stopped = False
            for s in params.stop:
                if s and s in text:
                    text, stopped = text[: text.index(s)], True
            n_prompt = sum(self.count_tokens(str(m.get("content", ""))) for m in p)
            out.append(
                GenerationResult(
                    text=text,
                    prompt_tokens=n_prompt,
                    completion_tokens=min(len(words), params.max_tokens),
                    finish_reason="length" if len(words) > params.max_tokens and not stopped else "stop",
                )
            )
        return out


@dataclass
class Faults:
    """Fault-injection knobs. Counters decrease as faults fire; ``delay_s`` applies to every request."""

    delay_s: float = 0.0
    fail_500: int = 0
    fail_429: int = 0
    malformed: int = 0
    retry_after_s: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def take(self) -> str | None:
        """The fault to inject into this request, if any (500 first, then 429, then malformed)."""
        with self._lock:
            for attr in ("fail_500", "fail_429", "malformed"):
                if getattr(self, attr) > 0:
                    setattr(self, attr, getattr(self, attr) - 1)
                    return attr
        return None


#: Largest request body accepted (413 above it). A prompt for a small served model fits in a few hundred KB;
#: without a bound one huge prompt holds the only model for as long as it takes to run.
MAX_BODY_BYTES = 1 << 20
#: Largest ``max_tokens`` a request may ask for (the served models' contexts are far smaller).
MAX_COMPLETION_TOKENS = 1 << 20
#: Seconds a connection may take to send its headers or body: a Content-Length larger than the body
#: sent ends in a 400 after this instead of holding a handler thread for ever.
BODY_TIMEOUT_S = 10.0


class BadRequest(Exception):
    """An invalid request: HTTP ``status`` (400 or 413) with an OpenAI-style error naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


class ChatServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` holding the LLM, its lock, the fault knobs and simple counters."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], llm: LLM, faults: Faults | None = None) -> None:
        super().__init__(addr, _Handler)
        self.llm = llm
        self.faults = faults or Faults()
        self.model_lock = threading.Lock()
        self.requests = 0
        #: whether the last chat request carried an ``Authorization`` header (tests check the client)
        self.last_authorization: str | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"


class _Handler(BaseHTTPRequestHandler):
    server: ChatServer
    protocol_version = "HTTP/1.1"
    timeout = BODY_TIMEOUT_S  # socket timeout of every read (StreamRequestHandler sets it on the connection)

    def log_message(self, fmt: str, *args: Any) -> None:  # route access logs to logging, never headers
        logger.debug("%s %s", self.address_string(), fmt % args)

    def _send(self, code: int, payload: Any = None, raw: bytes | None = None,
              headers: dict[str, str] | None = None) -> None:
        body = raw if raw is not None else json.dumps(payload).encode("utf-8")
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _error(self, code: int, message: str, etype: str = "invalid_request_error",
               headers: dict[str, str] | None = None, param: str | None = None) -> None:
        """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
        self._send(code, {"error": {"message": message, "type": etype, "param": param, "code": code}},
                   headers=headers)

    def _read_body(self) -> bytes:
        """The request body, or BadRequest: a missing, non-numeric or negative Content-Length, a body over
        MAX_BODY_BYTES (413), or fewer bytes than announced within BODY_TIMEOUT_S."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raise BadRequest("chunked request bodies are not supported; send a Content-Length", "Content-Length")
        text = (self.headers.get("Content-Length") or "").strip()
        if not text:
            return b""
        if not (text.isascii() and text.isdigit()):
            raise BadRequest(f"Content-Length must be a non-negative whole number, got {text[:40]!r}", "Content-Length")
        length = int(text)
        if length > MAX_BODY_BYTES:
            raise BadRequest(f"request body of {length} bytes is larger than the limit of {MAX_BODY_BYTES} bytes",
                             "Content-Length", status=413)
        try:
            raw = self.rfile.read(length)
        except TimeoutError:  # the client sent fewer bytes than announced and waits
            raise BadRequest(f"the body did not reach the {length} bytes that Content-Length announced within "
                             f"{BODY_TIMEOUT_S:g} s", "Content-Length") from None
        if len(raw) != length:  # the client closed its side early
            raise BadRequest(f"the body ended after {len(raw)} of the {length} bytes that Content-Length announced",
                             "Content-Length")
        return raw

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.rstrip("/") == "/health":
            self._send(200, {"status": "ok"})
        elif self.path.rstrip("/") == "/v1/models":
            self._send(200, {"object": "list", "data": [
                {"id": self.server.llm.name, "object": "model", "owned_by": "memgas",
                 "context_length": self.server.llm.context_tokens}]})
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._error(404, f"no route {self.path}")
            return
        try:
            raw = self._read_body()
        except BadRequest as exc:
            self.close_connection = True  # the rest of a bad body must not be read as the next request
            self._error(exc.status, str(exc), param=exc.param)
            return
        srv = self.server
        srv.requests += 1
        srv.last_authorization = self.headers.get("Authorization")
        faults = srv.faults
        if faults.delay_s > 0:
            time.sleep(faults.delay_s)
        fault = faults.take()
        if fault == "fail_500":
            self._error(500, "injected failure", "server_error")
            return
        if fault == "fail_429":
            hdr = {"Retry-After": str(faults.retry_after_s)} if faults.retry_after_s is not None else None
            self._error(429, "injected rate limit", "rate_limit_error", headers=hdr)
            return
        try:
            messages, params = parse_chat_request(raw)
        except BadRequest as exc:
            self._error(exc.status, str(exc), param=exc.param)
            return
        with srv.model_lock:
            result = srv.llm.generate([messages], params)[0]
        if fault == "malformed":
            self._send(200, raw=b'{"choices": [{"message": {"content": "trunc')
            return
        if result.error:
            self._error(500, result.error, "server_error")
            return
        self._send(200, {
            "id": f"chatcmpl-{srv.requests}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": srv.llm.name,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "finish_reason": result.finish_reason or "stop",
            }],
            "usage": {
                "prompt_tokens": result.prompt_tokens,
                "completion_tokens": result.completion_tokens,
                "total_tokens": result.prompt_tokens + result.completion_tokens,
            },
            "memgas": {"truncated": bool(result.extra.get("truncated", False))},
        })


def _number(req: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    v = req.get(key)
    if v is None:
        return default
    # bool is an int in Python; NaN and infinity fail the range test (json.loads accepts NaN and Infinity)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
        raise BadRequest(f"{key} must be a number in [{low:g}, {high:g}], got {json.dumps(v)[:40]}", key)
    return float(v)


def _whole(req: dict[str, Any], key: str, low: int, high: int) -> int | None:
    v = req.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise BadRequest(f"{key} must be a whole number in [{low}, {high}], got {json.dumps(v)[:40]}", key)
    return v


def parse_chat_request(raw: bytes) -> tuple[ChatPrompt, SamplingParams]:
    """(messages, sampling parameters) of a chat-completions body, or BadRequest naming the parameter.

    Nothing is substituted silently: ``max_tokens`` 0 or negative is refused (only a missing one takes
    the default, 256), and so is ``stream: true`` (this server answers whole completions only).
    """
    try:
        req = json.loads(raw or b"{}")
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the body is not valid JSON: {str(exc).splitlines()[0][:200]}") from None
    except RecursionError:
        raise BadRequest("the body is not valid JSON: nested too deeply") from None
    if not isinstance(req, dict):
        raise BadRequest("the body must be a JSON object")
    messages = req.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty array of {role, content} objects", "messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BadRequest(f"messages[{i}] must be an object with a string role and a string content",
                             f"messages[{i}]")
    if req.get("stream") not in (None, False):
        raise BadRequest("stream: true is not supported by memgas serve; send stream: false (or leave it out)",
                         "stream")
    max_key = "max_completion_tokens" if req.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _whole(req, max_key, 1, MAX_COMPLETION_TOKENS)
    stop = req.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        stop = tuple(stop)
    else:
        raise BadRequest("stop must be a string or an array of strings", "stop")
    rf = req.get("response_format")
    if rf is not None and not isinstance(rf, dict):
        raise BadRequest("response_format must be an object", "response_format")
    schema = None
    if (rf or {}).get("type") == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest("response_format.json_schema.schema must be an object", "response_format")
    seed = _whole(req, "seed", -(2**63), 2**63 - 1)
    params = SamplingParams(
        max_tokens=256 if max_tokens is None else max_tokens,
        temperature=_number(req, "temperature", 0.0, 0.0, 2.0),
        top_p=_number(req, "top_p", 1.0, 0.0, 1.0),
        stop=stop,
        seed=seed or 0,
        json_schema=schema,
    )
    return messages, params


def serve_in_thread(llm: LLM, host: str = "127.0.0.1", port: int = 0,
                    faults: Faults | None = None) -> tuple[ChatServer, threading.Thread]:
    """Start a server in a daemon thread (port 0 = a free port; read it from ``server.url``).
    Stop it with ``server.shutdown(); server.server_close()``."""
    srv = ChatServer((host, port), llm, faults)
    t = threading.Thread(target=srv.serve_forever, name=f"chat-server-{srv.server_address[1]}", daemon=True)
    t.start()
    return srv, t


def serve_forever_from_config(cfg: Any, *, host: str = "127.0.0.1", port: int = 8011, seed: int = 0,
                              faults: Faults | None = None, llm: LLM | None = None,
                              on_ready: Any = None) -> None:
    """``memgas serve``: serve the LLM of ``cfg`` (an :class:`~memgas.pipeline.config.LLMConfig`) until
    Ctrl-C or SIGTERM. ``llm`` serves that model instead of building one from ``cfg``; ``on_ready(server)``
    is called once the model is loaded (tests stop the server with ``server.shutdown()``).

    The socket is bound *before* the model loads, so a busy port or a bad host fails at once (OSError,
    which the CLI reports as one line, exit 3); requests that arrive while the model loads wait in the
    listen queue and are answered once it is ready.
    """
    import signal

    from memgas.pipeline.models.factory import make_llm

    srv = ChatServer((host, port), None, faults)  # type: ignore[arg-type] - the model follows
    previous = None
    try:
        srv.llm = llm if llm is not None else make_llm(cfg, seed=seed)
        if on_ready is not None:
            on_ready(srv)
        logger.info("serving %s at %s (POST /v1/chat/completions, GET /v1/models, GET /health)", srv.llm.name, srv.url)

        def _stop(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt

        try:
            previous = signal.signal(signal.SIGTERM, _stop)
        except ValueError:  # not the main thread: Ctrl-C only
            previous = None
        srv.serve_forever()
    except KeyboardInterrupt:
        logger.info("stopped serving at %s", srv.url)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        srv.server_close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="OpenAI-compatible chat-completions server over a memgas LLM")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--backend", default="transformers-gguf",
                    help="echo | transformers-gguf | llama-cpp | vllm | hf (see LLMConfig)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context-tokens", type=int, default=8192)
    ap.add_argument("--delay-s", type=float, default=0.0, help="sleep before every answer")
    ap.add_argument("--fail-500", type=int, default=0, help="answer the next N requests with HTTP 500")
    ap.add_argument("--fail-429", type=int, default=0, help="answer the next N requests with HTTP 429")
    ap.add_argument("--malformed", type=int, default=0, help="answer the next N requests with broken JSON")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    llm: LLM
    if a.backend == "echo":
        llm = EchoLLM(context_tokens=a.context_tokens)
    else:
        from memgas.pipeline.config import LLMConfig
        from memgas.pipeline.models.factory import make_llm

        llm = make_llm(LLMConfig(backend=a.backend, model=a.model, context_tokens=a.context_tokens))
    faults = Faults(delay_s=a.delay_s, fail_500=a.fail_500, fail_429=a.fail_429, malformed=a.malformed)
    srv = ChatServer((a.host, a.port), llm, faults)
    logger.info("serving %s at %s", llm.name, srv.url)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
