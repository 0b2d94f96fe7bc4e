"""A small OpenAI-compatible chat-completions server over any memgas LLM backend.

Endpoints: ``POST /v1/chat/completions`` (model, messages, max_tokens / max_completion_tokens,
temperature, top_p, stop, seed, response_format), ``GET /v1/models`` (exactly the model served),
``GET /v1/models/{id}``, ``GET /health``. The query string is ignored.

Errors follow OpenAI's contract: ``{"error": {"message", "type", "param", "code"}}`` with a JSON body for every
status. An invalid request gets 400 naming the parameter (``stream: true`` included: completions are answered
whole, never streamed; ``n`` other than 1, ``logprobs``, tools and fields OpenAI does not define are refused,
never ignored); an unknown ``model`` 404 ``model_not_found`` (a request without ``model`` gets the served one);
a route the method does not fit 405 with ``Allow``; an unknown route 404; a body over ``MAX_BODY_BYTES`` 413;
a body shorter than its Content-Length, or one still arriving ``BODY_TIMEOUT_S`` after the request's first byte, a
400; a request line or headers still arriving then a 408 (slowloris); a repeated Content-Length or any
Transfer-Encoding 400 (two framings of one body are how requests are smuggled past a proxy). Caps:
``MAX_MESSAGES`` messages, ``max_tokens`` below the model's context (400 ``integer_above_max_value``), and a
prompt that does not fit the rest of the context even when cut gets 400 ``context_length_exceeded``.
One request at a time reaches the model (a lock; batch size 1): this is for tests, demos and sharing one
CPU model between processes, not for throughput (use ``vllm serve`` for that).

Fault injection, for testing clients: ``delay_s`` before answering, the next N requests answer 500 / 429,
the next N answer malformed JSON, a valid completion of ``HUGE_FAULT_BYTES`` (``huge_body``), or a body that
never ends (``endless_body``: a byte every ``ENDLESS_FAULT_GAP_S`` until the client hangs up). Knobs are on
``server.faults`` and can be changed while it runs.

    python -m memgas.pipeline.models.server --port 8011                  # SmolLM2 (CPU default)
    python -m memgas.pipeline.models.server --port 8011 --backend echo --fail-500 2
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from memgas.pipeline.models.base import LLM, ChatPrompt, GenerationResult, SamplingParams
from memgas.pipeline.models.llms import PROMPT_TOO_LONG

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
            budget = self.context_tokens - min(params.max_tokens, self.context_tokens - 1)
            if n_prompt > budget:  # as a real backend that cannot cut the prompt enough reports it
                out.append(GenerationResult(error=f"PromptTooLong: prompt of {n_prompt} tokens does not fit "
                                                  f"in {budget}", extra={PROMPT_TOO_LONG: True}))
                continue
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
    huge_body: int = 0
    endless_body: int = 0
    retry_after_s: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def take(self) -> str | None:
        """The fault to inject into this request, if any (in this order: 500, 429, malformed, huge, endless)."""
        with self._lock:
            for attr in ("fail_500", "fail_429", "malformed", "huge_body", "endless_body"):
                if getattr(self, attr) > 0:
                    setattr(self, attr, getattr(self, attr) - 1)
                    return attr
        return None


#: Size of the ``huge_body`` fault's answer: a valid completion far over any client's sane response cap.
HUGE_FAULT_BYTES = 50 << 20
#: Seconds between the bytes of the ``endless_body`` fault's answer: far under any read timeout, so only a
#: client with a deadline for the whole response gives up.
ENDLESS_FAULT_GAP_S = 0.05

#: Largest request body accepted (413 above it). A prompt for a small served model fits in a few hundred KB;
#: without a bound one huge prompt holds the only model for as long as it takes to run.
MAX_BODY_BYTES = 1 << 20
#: Largest ``max_tokens`` a request may ask for (the served models' contexts are far smaller; the model's
#: context bounds it further: at most ``context_tokens - 1``, one token left for the prompt).
MAX_COMPLETION_TOKENS = 1 << 20
#: Most messages in one request (OpenAI's own cap). Each costs template tokens, and a prompt is re-rendered
#: whole while it is cut to fit: thousands of them hold the only model for nothing.
MAX_MESSAGES = 2048
#: Most stop sequences in one request (OpenAI's own cap).
MAX_STOP = 4
#: Roles a memgas chat prompt has and every served chat template renders; others (``tool``, ``function``,
#: ``developer``, made-up ones) are refused rather than rendered as text the model was never trained on.
ROLES = ("system", "user", "assistant")
#: Request fields this server honours.
SUPPORTED_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop",
                    "seed", "response_format", "stream")
#: Fields that change nothing in the answer (bookkeeping in OpenAI's API): accepted and ignored.
IGNORED_FIELDS = ("user", "metadata", "store")
#: Fields OpenAI defines that this server does not implement, with the values that ask for nothing
#: (accepted); any other value is refused with 400 rather than silently ignored.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": (None, False, True),
    "stream_options": (None,), "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,), "service_tier": (None, "auto", "default"),
}
#: Most characters of a client's value quoted back in an error message (a 500 KB model name was echoed whole).
MAX_QUOTED_CHARS = 200
#: Routes and the methods they take (405 for any other method).
ROUTES: dict[str, tuple[str, ...]] = {"/health": ("GET",), "/v1/models": ("GET",),
                                      "/v1/chat/completions": ("POST",)}
#: Methods answered 405 (or 404) with the JSON error instead of http.server's HTML 501.
OTHER_METHODS = ("PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "CONNECT")
#: Seconds a request may take to arrive whole (request line, headers and body, counted from its first byte), and
#: an idle keep-alive connection may wait for its next request. Past it the request is refused (408 while the
#: request line or headers arrive, the short body's 400 while the body does) and the connection is closed: a
#: client trickling a byte every few seconds (slowloris) never trips a per-read timeout, and would hold its
#: handler thread for as long as it liked. A Content-Length larger than the body sent ends the same way.
BODY_TIMEOUT_S = 10.0
#: Most connections open at once. Each holds a handler thread (idle keep-alive ones for up to
#: ``BODY_TIMEOUT_S``), so without a bound a client that opens thousands holds as many threads; past it a new
#: connection is answered 503 ``server_overloaded`` with ``Retry-After`` and closed, as a proxy in front would.
MAX_CONNECTIONS = 64


class BadRequest(Exception):
    """An invalid request: HTTP ``status`` (400, 404 or 413) with an OpenAI-style error naming ``param``, and
    OpenAI's machine-readable ``code`` where it has one (``model_not_found``, ``context_length_exceeded``...)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class ChatServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` holding the LLM, its lock, the fault knobs and simple counters."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], llm: LLM, faults: Faults | None = None,
                 aliases: Sequence[str] = (), max_connections: int = MAX_CONNECTIONS) -> None:
        super().__init__(addr, _Handler)
        #: a slot per open connection
        self.max_connections = max_connections
        self.connection_slots = threading.BoundedSemaphore(max_connections)
        self.refused_connections = 0
        self.llm = llm
        self.faults = faults or Faults()
        #: other names a request's ``model`` may give the served model (the config's, e.g. ``smollm2``);
        #: ``/v1/models`` lists only ``llm.name``, the name every answer carries
        self.aliases = tuple(aliases)
        self.created = int(time.time())
        self.model_lock = threading.Lock()
        self.requests = 0
        #: whether the last chat request carried an ``Authorization`` header (tests check the client)
        self.last_authorization: str | None = None

    def process_request(self, request: Any, client_address: Any) -> None:
        """A handler thread per connection while a slot is free; else a 503 at once (no thread)."""
        if not self.connection_slots.acquire(blocking=False):
            self.refused_connections += 1
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: its slot is free again
            self.connection_slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connection_slots.release()

    def _refuse(self, request: Any) -> None:
        """OpenAI's error body with 503 on a connection there is no slot for, written from the accepting thread
        (a few hundred bytes: the socket's buffer takes them), then the connection is closed unread."""
        body = json.dumps({"error": {"message": f"the server has {self.max_connections} connections open, its limit; "
                                                "retry later", "type": "server_error", "param": None,
                                     "code": "server_overloaded"}}).encode("utf-8")
        head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode("ascii")
        try:
            request.settimeout(1.0)
            request.sendall(head + body)
        except OSError:  # the client is gone or not reading: nothing more is owed to it
            pass
        self.shutdown_request(request)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"

    def serves(self, model: str) -> bool:
        return model == self.llm.name or model in self.aliases

    def model_card(self) -> dict[str, Any]:
        """The served model as OpenAI's model object (plus its context length)."""
        return {"id": self.llm.name, "object": "model", "created": self.created, "owned_by": "memgas",
                "context_length": self.llm.context_tokens}


class _Handler(BaseHTTPRequestHandler):
    server: ChatServer
    protocol_version = "HTTP/1.1"
    timeout = BODY_TIMEOUT_S  # socket timeout of every read (StreamRequestHandler sets it on the connection)
    _late = False  # the request did not arrive within ``timeout`` (its reads were cut off)
    _deadline: threading.Timer | None = None

    def handle_one_request(self) -> None:
        """http.server's, under a deadline: once the first byte of a request is in, the whole request must arrive
        within ``timeout`` seconds. Past it the read side is shut, so the blocked read returns what came, and the
        request is refused (``_late``). The deadline ends once the request is read, before the model runs."""
        try:
            if not self.rfile.peek(1):  # the client closed an idle connection
                self.close_connection = True
                return
        except TimeoutError:  # an idle keep-alive connection: closed after ``timeout``, as before
            self.close_connection = True
            return
        self._late = False
        self._deadline = threading.Timer(self.timeout, self._cut_off)
        self._deadline.daemon = True
        self._deadline.start()
        try:
            super().handle_one_request()
        finally:
            self._received()

    def _cut_off(self) -> None:
        self._late = True
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RD)  # wakes the blocked read with what has come; writes still work
        except OSError:  # already closed
            pass

    def _received(self) -> None:
        """The request is in (or given up): its deadline no longer applies."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _late_message(self) -> str:
        return f"the request did not arrive within {self.timeout:g} s (request line, headers and body)"

    def log_message(self, fmt: str, *args: Any) -> None:  # route access logs to logging, never headers
        logger.debug("%s %s", self.address_string(), fmt % args)

    def _error(self, status: int, message: str, etype: str = "invalid_request_error",
               headers: dict[str, str] | None = None, param: str | None = None, code: str | None = None) -> None:
        """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}`` (``code``: OpenAI's string
        or null; the HTTP status is the status line's)."""
        self._send(status, {"error": {"message": message, "type": etype, "param": param, "code": code}},
                   headers=headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (a malformed request line, headers too long, an unknown method) as the JSON
        error object instead of an HTML page; the connection is closed (what follows cannot be trusted)."""
        self.close_connection = True
        if self._late:  # what was cut off is not what the client meant to send
            code, message = 408, self._late_message()
        # a request line it could not parse leaves http.server in HTTP/0.9 mode, which writes no status line
        self.request_version = "HTTP/1.1" if self.request_version == "HTTP/0.9" else self.request_version
        self._error(code, message or explain or f"HTTP {code}", "server_error" if code >= 500 else
                    "invalid_request_error", headers={"Connection": "close"})

    def _send(self, code: int, payload: Any = None, raw: bytes | None = None,
              headers: dict[str, str] | None = None) -> None:
        body = raw if raw is not None else json.dumps(payload).encode("utf-8")
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        try:
            self.end_headers()
            if self.command != "HEAD":  # a HEAD answer has headers only
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client hung up (e.g. its timeout) before the answer
            self.close_connection = True
            logger.debug("client %s hung up before the %d answer", self.client_address, code)

    def _content_length(self) -> int | None:
        """The one Content-Length (None when absent), or BadRequest: repeated, not a whole number, or beside a
        Transfer-Encoding. Two framings of one body are how a request is smuggled past a proxy that reads the
        other one, so neither is chosen."""
        if self.headers.get_all("Transfer-Encoding"):
            raise BadRequest("Transfer-Encoding is not supported (chunked bodies included); send a Content-Length",
                             "Content-Length")
        values = self.headers.get_all("Content-Length") or []
        if len(values) > 1:
            raise BadRequest(f"{len(values)} Content-Length headers; send exactly one", "Content-Length")
        if not values or not values[0].strip():
            return None
        text = values[0].strip()
        if not (text.isascii() and text.isdigit()):
            raise BadRequest(f"Content-Length must be a non-negative whole number, got {text[:40]!r}", "Content-Length")
        return int(text)

    def _read_body(self) -> bytes:
        """The request body, or BadRequest: a bad Content-Length (see ``_content_length``), a body over
        MAX_BODY_BYTES (413), or fewer bytes than announced within the request's deadline (``timeout``)."""
        length = self._content_length()
        if not length:
            return b""
        if length > MAX_BODY_BYTES:
            raise BadRequest(f"request body of {length} bytes is larger than the limit of {MAX_BODY_BYTES} bytes",
                             "Content-Length", status=413)
        late = BadRequest(f"the body did not reach the {length} bytes that Content-Length announced within "
                          f"{self.timeout:g} s", "Content-Length")
        try:
            raw = self.rfile.read(length)
        except TimeoutError:  # the client sent fewer bytes than announced and waits
            raise late from None
        finally:
            self._received()
        if len(raw) != length and self._late:  # trickled past the deadline
            raise late
        if len(raw) != length:  # the client closed its side early
            raise BadRequest(f"the body ended after {len(raw)} of the {length} bytes that Content-Length announced",
                             "Content-Length")
        return raw

    def _route(self) -> str:
        """The request's path without its query string or trailing slash (``/`` stays ``/``)."""
        return urlsplit(self.path).path.rstrip("/") or "/"

    def _dispatch(self, method: str) -> None:
        if self._late:  # headers cut off at the deadline
            self._error(408, self._late_message(), headers={"Connection": "close"})
            return
        path = self._route()
        if not (method == "POST" and path == "/v1/chat/completions"):  # no body will be read
            self._received()
        allowed = ROUTES.get(path, ("GET",) if path.startswith("/v1/models/") else None)
        if method != "POST" or allowed is None or method not in allowed:
            # the body, if any, is not read: close, so that its bytes are never parsed as the next request
            lengths = self.headers.get_all("Content-Length") or []
            if self.headers.get_all("Transfer-Encoding") or any(v.strip() not in ("", "0") for v in lengths):
                self.close_connection = True
        if allowed is None:
            self._error(404, f"Invalid URL ({method} {path})")
        elif method not in allowed:
            self._error(405, f"Invalid method for URL ({method} {path})", headers={"Allow": ", ".join(allowed)})
        elif method == "GET":
            self._get(path)
        else:
            self._chat()

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def _get(self, path: str) -> None:
        srv = self.server
        if path == "/health":
            self._send(200, {"status": "ok"})
        elif path == "/v1/models":
            self._send(200, {"object": "list", "data": [srv.model_card()]})
        else:  # /v1/models/{id}; ids may hold a slash (HuggingFaceTB/SmolLM2-...)
            model = unquote(path[len("/v1/models/"):])
            if srv.serves(model):
                self._send(200, srv.model_card())
            else:
                self._error(404, _not_found(model), param="model", code="model_not_found")

    def _chat(self) -> None:
        try:
            raw = self._read_body()
        except BadRequest as exc:
            self.close_connection = True  # the rest of a bad body must not be read as the next request
            self._error(exc.status, str(exc), param=exc.param, code=exc.code)
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
            messages, params = parse_chat_request(raw, served=(srv.llm.name, *srv.aliases),
                                                  context_tokens=srv.llm.context_tokens)
            with srv.model_lock:
                result = srv.llm.generate([messages], params)[0]
        except BadRequest as exc:
            self._error(exc.status, str(exc), param=exc.param, code=exc.code)
            return
        except Exception as exc:  # noqa: BLE001 - a backend bug: a 500 with a JSON body, never a dropped connection
            logger.exception("chat completion failed")
            self._error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
            return
        if fault == "malformed":
            self._send(200, raw=b'{"choices": [{"message": {"content": "trunc')
            return
        if fault in ("huge_body", "endless_body"):
            self._send_hostile(fault)
            return
        if result.error:
            if result.extra.get(PROMPT_TOO_LONG):  # the request's fault: OpenAI's 400 for it
                self._error(400, f"the prompt does not fit this model's context of {srv.llm.context_tokens} tokens "
                            f"with max_tokens {params.max_tokens}, even with its messages cut ({result.error})",
                            param="messages", code="context_length_exceeded")
            else:
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

    def _send_hostile(self, fault: str) -> None:
        """A 200 that a client must not read whole: a valid completion of HUGE_FAULT_BYTES, or a chunked body of
        whitespace that never ends. Stops when the client hangs up."""
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        head, tail = b'{"choices": [{"message": {"content": "', b'"}, "finish_reason": "stop"}]}'
        if fault == "huge_body":
            self.send_header("Content-Length", str(HUGE_FAULT_BYTES))
        else:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            if fault == "huge_body":
                self.wfile.write(head)
                left = HUGE_FAULT_BYTES - len(head) - len(tail)
                while left > 0:
                    n = min(left, 1 << 20)
                    self.wfile.write(b"a" * n)
                    left -= n
                self.wfile.write(tail)
            else:
                while True:  # JSON may start with any amount of whitespace: the body is never invalid, only endless
                    self.wfile.write(b"1\r\n \r\n")
                    self.wfile.flush()
                    time.sleep(ENDLESS_FAULT_GAP_S)
        except OSError:  # the client hung up (what a client with a cap or a deadline does)
            pass


def _dispatching(method: str) -> Any:
    def handler(self: _Handler) -> None:
        self._dispatch(method)
    handler.__name__ = f"do_{method}"
    return handler


for _method in OTHER_METHODS:
    setattr(_Handler, f"do_{_method}", _dispatching(_method))


def _not_found(model: str) -> str:
    shown = model if len(model) <= MAX_QUOTED_CHARS else model[:MAX_QUOTED_CHARS] + "..."
    return f"The model `{shown}` does not exist or you do not have access to it."


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
        code = None if isinstance(v, bool) or not isinstance(v, int) else \
            "integer_below_min_value" if v < low else "integer_above_max_value"  # OpenAI's codes for these
        raise BadRequest(f"{key} must be a whole number in [{low}, {high}], got {json.dumps(v)[:40]}", key, code=code)
    return v


def parse_chat_request(raw: bytes, *, served: Sequence[str] = (),
                       context_tokens: int | None = None) -> tuple[ChatPrompt, SamplingParams]:
    """(messages, sampling parameters) of a chat-completions body, or BadRequest naming the parameter.

    Nothing is substituted or ignored silently: ``max_tokens`` 0 or negative is refused (only a missing one
    takes the default, 256), and so are ``stream: true`` (whole completions only), fields OpenAI does not
    define, and those it defines that this server does not implement unless they ask for nothing
    (:data:`NEUTRAL_VALUES`). Given ``served`` (the model's names), another ``model`` is a 404
    ``model_not_found``; given ``context_tokens``, ``max_tokens`` must leave a token for the prompt.
    """
    try:
        req = json.loads(raw or b"{}")
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the body is not valid JSON: {str(exc).splitlines()[0][:200]}") from None
    except RecursionError:
        raise BadRequest("the body is not valid JSON: nested too deeply") from None
    if not isinstance(req, dict):
        raise BadRequest("the body must be a JSON object")
    _check_fields(req)
    model = req.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {json.dumps(model)[:40]}", "model")
    if model is not None and served and model not in served:
        raise BadRequest(_not_found(model), "model", status=404, code="model_not_found")
    messages = _messages(req.get("messages"))
    if req.get("stream") not in (None, False):
        raise BadRequest("stream: true is not supported by memgas serve; send stream: false (or leave it out)",
                         "stream")
    max_key = "max_completion_tokens" if req.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _whole(req, max_key, 1, MAX_COMPLETION_TOKENS)
    if max_tokens is not None and context_tokens is not None and max_tokens >= context_tokens:
        raise BadRequest(f"Invalid '{max_key}': integer above maximum value. Expected a value <= "
                         f"{context_tokens - 1} (this model's context is {context_tokens} tokens, and the prompt "
                         f"needs at least one), but got {max_tokens} instead.", max_key,
                         code="integer_above_max_value")
    stop = req.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        if len(stop) > MAX_STOP:  # each is searched in the text after every step
            raise BadRequest(f"Invalid 'stop': array too long. Expected an array with maximum length {MAX_STOP}, "
                             f"but got an array with length {len(stop)} instead.", "stop",
                             code="array_above_max_length")
        stop = tuple(stop)
    else:
        raise BadRequest("stop must be a string or an array of strings", "stop")
    if any(not x for x in stop):  # it matches before the first token: a stop that can mean nothing
        raise BadRequest("stop sequences must be non-empty strings", "stop")
    params = SamplingParams(
        max_tokens=256 if max_tokens is None else max_tokens,
        temperature=_number(req, "temperature", 0.0, 0.0, 2.0),
        top_p=_number(req, "top_p", 1.0, 0.0, 1.0),
        stop=stop,
        seed=_whole(req, "seed", -(2**63), 2**63 - 1) or 0,
        json_schema=_json_schema(req.get("response_format")),
    )
    return messages, params


def _check_fields(req: dict[str, Any]) -> None:
    """Refuse fields OpenAI does not define (as OpenAI does), and defined ones this server cannot honour
    unless their value asks for nothing: a request never gets an answer that silently ignored part of it."""
    for key, value in req.items():
        if key in SUPPORTED_FIELDS or key in IGNORED_FIELDS:
            continue
        if key not in NEUTRAL_VALUES:
            raise BadRequest(f"Unrecognized request argument supplied: {key[:80]}", key[:80])
        # type-exact: true == 1 and 1.0 == 1 in Python, but n: true is not n: 1
        if not any(value is None if v is None else (type(value) is type(v) and value == v)
                   for v in NEUTRAL_VALUES[key]):
            raise BadRequest(f"{key} {json.dumps(value)[:60]} is not supported by memgas serve (one choice, plain "
                             f"text, no tools or log-probabilities); leave {key} out", key)


def _messages(messages: Any) -> ChatPrompt:
    """``messages``: 1 to MAX_MESSAGES objects, each with a role in ROLES and a string content that is valid
    Unicode (JSON's ``\\ud800`` escapes decode to lone surrogates, which no tokenizer takes)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty array of {role, content} objects", "messages")
    if len(messages) > MAX_MESSAGES:
        raise BadRequest(f"Invalid 'messages': array too long. Expected an array with maximum length {MAX_MESSAGES}, "
                         f"but got an array with length {len(messages)} instead.", "messages",
                         code="array_above_max_length")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BadRequest(f"messages[{i}] must be an object with a string role and a string content",
                             f"messages[{i}]")
        if m["role"] not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {json.dumps(m['role'])[:40]}",
                             f"messages[{i}].role")
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadRequest(f"messages[{i}].content is not valid Unicode text: a lone surrogate "
                             f"{json.dumps(exc.object[exc.start])} at character {exc.start}",
                             f"messages[{i}].content") from None
    return messages


def _json_schema(rf: Any) -> dict | None:
    """The schema of ``response_format`` (``text``, ``json_object`` or ``json_schema``), None when none."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise BadRequest("response_format must be an object", "response_format")
    kind = rf.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise BadRequest(f"response_format.type must be text, json_object or json_schema, got "
                         f"{json.dumps(kind)[:40]}", "response_format")
    if kind != "json_schema":
        return None
    js = rf.get("json_schema")
    schema = js.get("schema") if isinstance(js, dict) else None
    if not isinstance(schema, dict):
        raise BadRequest("response_format.json_schema.schema must be an object", "response_format")
    return schema


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
        if llm is not None:
            srv.llm = llm
        else:  # requests may name the model as the config does (``smollm2``) or as /v1/models lists it
            srv.llm = make_llm(cfg, seed=seed)
            srv.aliases = tuple(name for name in (getattr(cfg, "model", None),) if isinstance(name, str) and name)
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
    srv = ChatServer((a.host, a.port), llm, faults, aliases=() if a.backend == "echo" else (a.model,))
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
