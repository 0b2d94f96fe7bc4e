"""The HTTP side of ``memgas serve``: one :class:`ChatHandler` per connection (http.server's threading model).

It reads a request under a deadline (slowloris), routes it, answers OpenAI's JSON error for everything it refuses,
and hands a valid chat request to the model through the server's queue.
"""

from __future__ import annotations

import inspect
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import unquote, urlsplit

from memgas.pipeline.models.backend_common import CANCELLED, PROMPT_TOO_LONG, SCHEMA_UNSUPPORTED
from memgas.pipeline.models.chat_request import BadRequest, check_context, not_found, parse_chat_request
from memgas.pipeline.models.model_queue import ClientGone, QueueFull, ShuttingDown, client_gone

logger = logging.getLogger(__name__)

#: Size of the ``huge_body`` fault's answer: a valid completion far over any client's sane response cap.
HUGE_FAULT_BYTES = 50 << 20
#: Seconds between the bytes of the ``endless_body`` fault's answer: far under any read timeout, so only a
#: client with a deadline for the whole response gives up.
ENDLESS_FAULT_GAP_S = 0.05

#: Largest request body accepted (413 above it). A prompt for a small served model fits in a few hundred KB;
#: without a bound one huge prompt holds the only model for as long as it takes to run.
MAX_BODY_BYTES = 1 << 20
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
#: The message of the 503 that a request gets while the server stops (SIGTERM, Ctrl-C).
SHUTTING_DOWN = "the server is shutting down; retry against another one, or once it is back"


class ChatHandler(BaseHTTPRequestHandler):
    server: Any  # a memgas.pipeline.models.server.ChatServer
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
                self._error(404, not_found(model), param="model", code="model_not_found")

    def _chat(self) -> None:
        try:
            raw = self._read_body()
        except BadRequest as exc:
            self.close_connection = True  # the rest of a bad body must not be read as the next request
            self._error(exc.status, str(exc), param=exc.param, code=exc.code)
            return
        with self.server.queue.handling():  # a stopping server waits for this answer to be written
            self._complete(raw)

    def _gone(self) -> bool:
        return client_gone(self.connection)

    def _cancelled(self) -> bool:
        return self.server.queue.stopping.is_set() or self._gone()

    def _shutting_down(self) -> None:
        self.close_connection = True
        self._error(503, SHUTTING_DOWN, "server_error", headers={"Connection": "close", "Retry-After": "1"},
                    code="server_shutting_down")

    def _complete(self, raw: bytes) -> None:
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
            with srv.queue.turn(self._gone):
                count = getattr(srv.llm, "count_prompt_tokens", None)
                if count is not None:  # refused before it runs; a backend without it is checked by its result
                    check_context(count(messages), params.max_tokens, srv.llm.context_tokens)
                if "cancelled" in inspect.signature(srv.llm.generate).parameters:
                    result = srv.llm.generate([messages], params, cancelled=self._cancelled)[0]
                else:
                    result = srv.llm.generate([messages], params)[0]
        except BadRequest as exc:
            self._error(exc.status, str(exc), param=exc.param, code=exc.code)
            return
        except QueueFull as exc:
            self._error(503, str(exc), "server_error", headers={"Retry-After": str(exc.retry_after_s)},
                        code="server_overloaded")
            return
        except ShuttingDown:
            self._shutting_down()
            return
        except ClientGone:  # nobody is left to answer
            self.close_connection = True
            logger.debug("client %s hung up while its request waited for the model", self.client_address)
            return
        except Exception as exc:  # noqa: BLE001 - a backend bug: a 500 with a JSON body, never a dropped connection
            logger.exception("chat completion failed")
            self._error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
            return
        if result.extra.get(CANCELLED):
            self.close_connection = True
            if srv.queue.stopping.is_set():
                self._shutting_down()
            else:
                logger.debug("client %s hung up while the model generated; generation stopped", self.client_address)
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
            elif result.extra.get(SCHEMA_UNSUPPORTED):
                self._error(400, f"response_format.json_schema.schema: {result.error}", param="response_format")
            else:
                self._error(500, result.error, "server_error")
            return
        if result.extra.get("truncated"):  # a backend that cuts prompts to fit: refused as the others are
            self._error(400, f"the prompt does not fit this model's context of {srv.llm.context_tokens} tokens with "
                        f"max_tokens {params.max_tokens}", param="messages", code="context_length_exceeded")
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
    def handler(self: ChatHandler) -> None:
        self._dispatch(method)
    handler.__name__ = f"do_{method}"
    return handler


for _method in OTHER_METHODS:
    setattr(ChatHandler, f"do_{_method}", _dispatching(_method))

