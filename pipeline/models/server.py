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
prompt that does not fit the context with ``max_tokens`` gets 400 ``context_length_exceeded`` (never cut).
One request at a time reaches the model (batch size 1) and at most ``max_queue`` wait for it (503
``server_overloaded`` with ``Retry-After`` past it; :mod:`~memgas.pipeline.models.model_queue`); a request whose
client hangs up leaves the queue, or stops generating at the next step. SIGTERM or Ctrl-C cancels the running
generation, answers what is in progress with 503 ``server_shutting_down`` and exits 0. This is for tests, demos
and sharing one CPU model between processes, not for throughput (use ``vllm serve`` for that).

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
import threading
import time
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from collections.abc import Sequence
from typing import Any

from memgas.pipeline.models.base import LLM, ChatPrompt, GenerationResult, SamplingParams
from memgas.pipeline.models.chat_handler import (  # noqa: F401 - the handler's limits, re-exported for callers
    BODY_TIMEOUT_S, ENDLESS_FAULT_GAP_S, HUGE_FAULT_BYTES, MAX_BODY_BYTES, ChatHandler)
from memgas.pipeline.models.chat_request import (  # noqa: F401 - re-exported: the request contract's limits
    MAX_COMPLETION_TOKENS, MAX_MESSAGES, MAX_QUOTED_CHARS, MAX_STOP, BadRequest, parse_chat_request)
from memgas.pipeline.models.llms import PROMPT_TOO_LONG
from memgas.pipeline.models.model_queue import MAX_QUEUE, ModelQueue

logger = logging.getLogger(__name__)

#: http.server's handler class of every connection (tests shorten its ``timeout``)
_Handler = ChatHandler


class EchoLLM:
    """Tiny deterministic LLM for tests: answers with the last message's words, cut to ``max_tokens``
    words (one word = one token). ``context_tokens`` bounds the prompt like a real model's."""

    def __init__(self, name: str = "echo", context_tokens: int = 4096) -> None:
        self.name = name
        self.context_tokens = context_tokens

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def count_prompt_tokens(self, messages: ChatPrompt) -> int:
        return sum(self.count_tokens(str(m.get("content", ""))) for m in messages)

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


#: Most connections open at once. Each holds a handler thread (idle keep-alive ones for up to
#: ``BODY_TIMEOUT_S``), so without a bound a client that opens thousands holds as many threads; past it a new
#: connection is answered 503 ``server_overloaded`` with ``Retry-After`` and closed, as a proxy in front would.
MAX_CONNECTIONS = 64
#: Most seconds a stopping server (SIGTERM, Ctrl-C) waits for the requests it is answering: a generation is
#: cancelled at its next decoding step, but a backend that cannot be cancelled (an HTTP one) runs to its end.
SHUTDOWN_GRACE_S = 30.0


class ChatServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` holding the LLM, the queue in front of it, the fault knobs and simple counters."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], llm: LLM, faults: Faults | None = None,
                 aliases: Sequence[str] = (), max_connections: int = MAX_CONNECTIONS,
                 max_queue: int = MAX_QUEUE) -> None:
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
        #: one request at a time reaches the model, at most ``max_queue`` wait for it
        self.queue = ModelQueue(max_queue)
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



def serve_in_thread(llm: LLM, host: str = "127.0.0.1", port: int = 0, faults: Faults | None = None,
                    max_queue: int = MAX_QUEUE) -> tuple[ChatServer, threading.Thread]:
    """Start a server in a daemon thread (port 0 = a free port; read it from ``server.url``).
    Stop it with ``server.shutdown(); server.server_close()``."""
    srv = ChatServer((host, port), llm, faults, max_queue=max_queue)
    t = threading.Thread(target=srv.serve_forever, name=f"chat-server-{srv.server_address[1]}", daemon=True)
    t.start()
    return srv, t


def serve_until_stopped(srv: ChatServer) -> None:
    """Serve until Ctrl-C or SIGTERM (in the main thread; elsewhere until ``srv.shutdown()``), then stop in order:
    no new connection is accepted, the running generation is cancelled at its next step and waiting requests
    leave the queue, each answered 503 ``server_shutting_down``; return once they are answered (at most
    ``SHUTDOWN_GRACE_S``). Python's exit while a handler thread is still inside the model aborted the process
    (exit 134: "terminate called without an active exception")."""
    import signal

    def _stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM while stopping changes nothing
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, _stop)
    except ValueError:  # not the main thread: Ctrl-C only
        previous = None
    try:
        try:
            srv.serve_forever()
        except KeyboardInterrupt:
            pass
        logger.info("stopping: answering the requests in progress")
        if not srv.queue.stop(SHUTDOWN_GRACE_S):
            logger.warning("requests still running %g s after the shutdown signal; exiting without their answers",
                           SHUTDOWN_GRACE_S)
        logger.info("stopped serving at %s", srv.url)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        srv.server_close()


def serve_forever_from_config(cfg: Any, *, host: str = "127.0.0.1", port: int = 8011, seed: int = 0,
                              faults: Faults | None = None, llm: LLM | None = None,
                              on_ready: Any = None, max_queue: int = MAX_QUEUE) -> None:
    """``memgas serve``: serve the LLM of ``cfg`` (an :class:`~memgas.pipeline.config.LLMConfig`) until
    Ctrl-C or SIGTERM (:func:`serve_until_stopped`). ``llm`` serves that model instead of building one from
    ``cfg``; ``on_ready(server)`` is called once the model is loaded (tests stop the server with
    ``server.shutdown()``); ``max_queue`` requests may wait for the model (503 past it).

    The socket is bound *before* the model loads, so a busy port or a bad host fails at once (OSError,
    which the CLI reports as one line, exit 3); requests that arrive while the model loads wait in the
    listen queue and are answered once it is ready.
    """
    from memgas.pipeline.models.factory import make_llm

    srv = ChatServer((host, port), None, faults, max_queue=max_queue)  # type: ignore[arg-type] - the model follows
    try:
        if llm is not None:
            srv.llm = llm
        else:  # requests may name the model as the config does (``smollm2``) or as /v1/models lists it
            srv.llm = make_llm(cfg, seed=seed)
            srv.aliases = tuple(name for name in (getattr(cfg, "model", None),) if isinstance(name, str) and name)
        if on_ready is not None:
            on_ready(srv)
        logger.info("serving %s at %s (POST /v1/chat/completions, GET /v1/models, GET /health; at most %d requests "
                    "wait for the model)", srv.llm.name, srv.url, max_queue)
    except BaseException:
        srv.server_close()
        raise
    serve_until_stopped(srv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="OpenAI-compatible chat-completions server over a memgas LLM")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--backend", default="transformers-gguf",
                    help="echo | transformers-gguf | llama-cpp | vllm | hf (see LLMConfig)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context-tokens", type=int, default=8192)
    ap.add_argument("--max-queue", type=int, default=MAX_QUEUE,
                    help="requests that may wait for the model behind the one it runs (503 past it)")
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
    srv = ChatServer((a.host, a.port), llm, faults, aliases=() if a.backend == "echo" else (a.model,),
                     max_queue=a.max_queue)
    logger.info("serving %s at %s", llm.name, srv.url)
    serve_until_stopped(srv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
