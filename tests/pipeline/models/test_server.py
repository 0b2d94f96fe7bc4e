"""`memgas serve`: the OpenAI-compatible endpoint over the configured LLM.

The fast test serves the tiny echo model in a thread; the slow one starts the real command as a
subprocess with the CPU default (SmolLM2 through transformers' GGUF loader) and calls it with httpx.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from memgas.pipeline.config import LLMConfig
from memgas.pipeline.models.llms import SMOLLM2_NAME
from memgas.pipeline.models.server import ChatServer, EchoLLM, serve_forever_from_config

REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_forever_from_config_answers_and_stops() -> None:
    ready = threading.Event()
    holder = {}

    def on_ready(srv) -> None:
        holder["srv"] = srv
        ready.set()

    t = threading.Thread(target=serve_forever_from_config, args=(LLMConfig(),),
                         kwargs={"port": 0, "llm": EchoLLM(), "on_ready": on_ready}, daemon=True)
    t.start()
    assert ready.wait(30)
    srv = holder["srv"]
    try:
        r = httpx.post(f"{srv.url}/chat/completions", json={"model": "echo", "max_tokens": 3,
                       "messages": [{"role": "user", "content": "one two three four"}]}, timeout=30)
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "one two three"
        assert httpx.get(f"{srv.url}/models", timeout=30).json()["data"][0]["id"] == "echo"
    finally:
        srv.shutdown()
    t.join(30)
    assert not t.is_alive()


def test_a_busy_port_fails_before_the_model_loads() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        loaded = []
        with pytest.raises(OSError) as exc:
            serve_forever_from_config(LLMConfig(), port=port, on_ready=lambda srv: loaded.append(srv))
        assert "in use" in str(exc.value) and not loaded


#: ``memgas serve --max-queue`` of the served CPU model below: the queue tests fill it exactly
QUEUE = 8


class _Served:
    """A ``memgas serve`` subprocess with the CPU model (SmolLM2), shared by the tests of this module."""

    def __init__(self) -> None:
        self.port = _free_port()
        exe = Path(sys.executable).with_name("memgas")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1"}
        self.proc = subprocess.Popen([str(exe), "serve", "--port", str(self.port), "--set", "llm.threads=1",
                                      "--max-queue", str(QUEUE)], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.base = f"http://127.0.0.1:{self.port}/v1"
        self.stopped: tuple[int | None, str] | None = None
        self.health = self._wait_ready()

    def _wait_ready(self) -> httpx.Response:
        deadline = time.time() + 300
        while True:  # the socket is bound at once; requests wait until the model is loaded
            assert self.proc.poll() is None, self.proc.communicate()[1][-2000:]
            try:
                return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=300)
            except httpx.ConnectError:
                assert time.time() < deadline
                time.sleep(0.2)

    def chat(self, max_tokens: int, content: str = "Write a long story about a dragon.", timeout: float = 300,
             **fields) -> httpx.Response:
        body = json.dumps({"model": "smollm2", "max_tokens": max_tokens, "temperature": 0,
                           "messages": [{"role": "user", "content": content}], **fields})
        return httpx.post(f"{self.base}/chat/completions", content=body, timeout=timeout,
                          headers={"Content-Type": "application/json"})  # ASCII: a lone surrogate stays escaped

    def send_and_hold(self, max_tokens: int) -> socket.socket:
        """A raw connection that sent a whole chat request and reads nothing (close it to hang up)."""
        body = json.dumps({"model": "smollm2", "max_tokens": max_tokens, "temperature": 0,
                           "messages": [{"role": "user", "content": "Write a long story about a dragon."}]}).encode()
        s = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        return s

    def stop(self) -> tuple[int | None, str]:
        """SIGTERM, then (exit status or None when it had to be killed, stderr); once only."""
        if self.stopped is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                _, err = self.proc.communicate(timeout=60)
                self.stopped = (self.proc.returncode, err)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.stopped = (None, self.proc.communicate()[1])
        return self.stopped


@pytest.fixture(scope="module")
def cpu_serve():
    served = _Served()
    yield served
    served.stop()


@pytest.mark.slow
def test_memgas_serve_with_the_cpu_model(cpu_serve) -> None:
    base = cpu_serve.base
    assert cpu_serve.health.json() == {"status": "ok"}
    r = httpx.post(f"{base}/chat/completions", timeout=300, json={
        "model": "smollm2", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}]})
    assert r.status_code == 200, r.text
    body = r.json()
    text = body["choices"][0]["message"]["content"]
    assert isinstance(text, str) and text.strip()
    assert 0 < body["usage"]["completion_tokens"] <= 8 and body["usage"]["prompt_tokens"] > 5
    models = httpx.get(f"{base}/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [SMOLLM2_NAME] == [body["model"]]  # exactly the model served
    context = models[0]["context_length"]
    # the real tokenizer's and the real backend's failures are the client's 400s, never 500s (nor a 200 that cut
    # the prompt)
    refused = {
        "max_tokens over the context": ({"max_tokens": 1048576}, "max_tokens", "integer_above_max_value"),
        "a prompt that cannot fit": ({"max_tokens": context - 1}, "messages", "context_length_exceeded"),
        "a prompt longer than the context": ({"messages": [{"role": "user", "content": "word " * context}],
                                              "max_tokens": 4}, "messages", "context_length_exceeded"),
        "a lone surrogate": ({"messages": [{"role": "user", "content": "a \ud800 b"}]}, "messages[0].content",
                             None),
        "a lone surrogate in stop": ({"stop": "\ud800"}, "stop", None),
        "a schema of an unknown type": ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objekt"}}}}, "response_format", None),
        "a schema the CPU backend cannot enforce": ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"not": {"type": "string"}}}}}, "response_format", None),
        "another model": ({"model": "gpt-4o"}, "model", "model_not_found"),
    }
    for what, (fields, param, code) in refused.items():
        body = json.dumps({"model": SMOLLM2_NAME, "messages": [{"role": "user", "content": "Hello"}],
                           "max_tokens": 4, **fields})
        r = httpx.post(f"{base}/chat/completions", timeout=300, content=body,  # ASCII: \ud800 escaped
                       headers={"Content-Type": "application/json"})
        err = r.json()["error"]
        assert (r.status_code, err["type"], err["param"], err["code"]) == (
            404 if code == "model_not_found" else 400, "invalid_request_error", param, code), what
    r = cpu_serve.chat(4, "word " * context)
    prompt = context + 31  # a token per word, and the chat template with SmolLM2's default system prompt
    assert r.json()["error"]["message"] == (
        f"This model's maximum context length is {context} tokens. However, you requested {prompt + 4} tokens "
        f"({prompt} in the messages, 4 in the completion). Please reduce the length of the messages or completion.")


@pytest.mark.slow
def test_clients_that_hang_up_do_not_hold_the_model(cpu_serve) -> None:
    """8 clients send a 256-token request and hang up: the one generating stops at its next step, and those
    waiting leave the queue, so the next request is answered at once (before: the abandoned generations ran one
    by one under the model lock, ~10-40 s each on this model)."""
    held = [cpu_serve.send_and_hold(256) for _ in range(QUEUE)]
    time.sleep(1.0)  # read by the server, the first one generating
    for s in held:
        s.close()
    t0 = time.monotonic()
    r = cpu_serve.chat(4, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert time.monotonic() - t0 < 10


@pytest.mark.slow
def test_a_request_past_the_queue_gets_503_with_retry_after(cpu_serve) -> None:
    """--max-queue 8: with one request generating and 8 waiting, the next one is refused at once with 503
    ``server_overloaded`` and ``Retry-After``; once the clients ahead hang up, a request is served within
    seconds (their 9 x 256 tokens would take minutes). A hang-up is seen by a waiting request within
    ``WAIT_POLL_S`` and by the running generation at its next decoding step, not at the instant of the close:
    until then the queue is still full and a request is refused with 503, which a client retries."""
    held = [cpu_serve.send_and_hold(256) for _ in range(QUEUE + 1)]
    try:
        time.sleep(1.0)
        t0 = time.monotonic()
        r = cpu_serve.chat(4, timeout=60)
        assert time.monotonic() - t0 < 5
        err = r.json()["error"]
        assert (r.status_code, err["type"], err["param"], err["code"]) == (503, "server_error", None,
                                                                            "server_overloaded")
        retry = int(r.headers["Retry-After"])
        assert err["message"] == (f"the model is busy and {QUEUE} requests wait for it, the most this server queues "
                                  f"(memgas serve --max-queue); retry after {retry} s")
        assert 1 <= retry <= 60
    finally:
        for s in held:
            s.close()
    t0 = time.monotonic()
    r = cpu_serve.chat(4, timeout=60)
    while r.status_code == 503 and time.monotonic() - t0 < 10:
        time.sleep(0.25)
        r = cpu_serve.chat(4, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert time.monotonic() - t0 < 10


@pytest.mark.slow
def test_sigterm_during_a_generation_answers_503_and_exits_0(cpu_serve) -> None:
    """The last test of the module: it stops the shared server. SIGTERM while the model generates cancels the
    generation, answers its client 503 ``server_shutting_down`` and exits 0 (before: exit 134, "terminate called
    without an active exception", the client's connection dropped)."""
    box: list = []
    client = threading.Thread(target=lambda: box.append(cpu_serve.chat(256, timeout=120)))
    client.start()
    time.sleep(1.5)  # generating
    t0 = time.monotonic()
    code, err = cpu_serve.stop()
    client.join(30)
    assert (code, time.monotonic() - t0 < 15) == (0, True), err[-2000:]
    r = box[0]
    assert r.status_code == 503 and r.json() == {"error": {
        "message": "the server is shutting down; retry against another one, or once it is back",
        "type": "server_error", "param": None, "code": "server_shutting_down"}}
    assert "Traceback" not in err and "terminate called" not in err


# -- invalid requests: 400/413 with an OpenAI-style error body, never a 500, a hang or a dropped connection --

from memgas.pipeline.models import server as server_mod  # noqa: E402
from memgas.pipeline.models.server import serve_in_thread  # noqa: E402


@pytest.fixture(scope="module")
def echo_server():
    srv, t = serve_in_thread(EchoLLM())
    yield srv
    srv.shutdown()
    srv.server_close()
    t.join(10)


def _post(srv, body: bytes | str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    host, port = srv.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body=body,
                     headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


_MSG = [{"role": "user", "content": "one two three"}]

#: (id, request body, HTTP status, the error's param, the error's code)
BAD_REQUESTS = [
    ("not-json", "{oops", 400, None, None),
    ("not-an-object", "[1, 2]", 400, None, None),
    ("no-messages", {"model": "echo"}, 400, "messages", None),
    ("empty-messages", {"messages": []}, 400, "messages", None),
    ("messages-not-a-list", {"messages": "hi"}, 400, "messages", None),
    ("content-not-a-string", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0]", None),
    ("message-not-an-object", {"messages": ["hi"]}, 400, "messages[0]", None),
    ("nan-temperature", '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, "temperature",
     None),
    ("temperature-a-string", {"messages": _MSG, "temperature": "hot"}, 400, "temperature", None),
    ("top-p-above-1", {"messages": _MSG, "top_p": 1.5}, 400, "top_p", None),
    ("huge-max-tokens", {"messages": _MSG, "max_tokens": 10**30}, 400, "max_tokens", "integer_above_max_value"),
    ("max-tokens-zero", {"messages": _MSG, "max_tokens": 0}, 400, "max_tokens", "integer_below_min_value"),
    ("max-tokens-negative", {"messages": _MSG, "max_tokens": -5}, 400, "max_tokens", "integer_below_min_value"),
    ("max-tokens-a-float", {"messages": _MSG, "max_tokens": 2.5}, 400, "max_tokens", None),
    ("max-completion-tokens-zero", {"messages": _MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens",
     "integer_below_min_value"),
    ("stop-a-number", {"messages": _MSG, "stop": 3}, 400, "stop", None),
    ("seed-a-string", {"messages": _MSG, "seed": "x"}, 400, "seed", None),
    ("stream-true", {"messages": _MSG, "stream": True}, 400, "stream", None),
    ("response-format-a-string", {"messages": _MSG, "response_format": "json"}, 400, "response_format", None),
    # what the client got wrong is a 400 naming it, never a 200 that ignores it or a 500
    ("max-tokens-over-the-context", {"messages": _MSG, "max_tokens": 1048576}, 400, "max_tokens",
     "integer_above_max_value"),
    ("max-tokens-the-whole-context", {"messages": _MSG, "max_tokens": 4096}, 400, "max_tokens",
     "integer_above_max_value"),
    ("prompt-beyond-the-context", {"messages": [{"role": "user", "content": "w " * 4000}], "max_tokens": 100},
     400, "messages", "context_length_exceeded"),
    ("n-2", {"messages": _MSG, "n": 2}, 400, "n", None),
    ("n-true", {"messages": _MSG, "n": True}, 400, "n", None),
    ("logprobs-true", {"messages": _MSG, "logprobs": True}, 400, "logprobs", None),
    ("top-logprobs", {"messages": _MSG, "top_logprobs": 3}, 400, "top_logprobs", None),
    ("tools", {"messages": _MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", None),
    ("unknown-field", {"messages": _MSG, "frobnicate": 1}, 400, "frobnicate", None),
    ("role-wizard", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", None),
    ("lone-surrogate", '{"messages": [{"role": "user", "content": "a \\ud800 b"}]}', 400, "messages[0].content",
     None),
    ("10000-messages", {"messages": [{"role": "user", "content": "hi"}] * 10_000}, 400, "messages",
     "array_above_max_length"),
    ("model-not-a-string", {"model": 5, "messages": _MSG}, 400, "model", None),
    ("5-stop-sequences", {"messages": _MSG, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "array_above_max_length"),
    # hostile pass: an empty stop string matches before the first token (transformers stopped after one token
    # and called it "length"); it can mean nothing else
    ("stop-empty-string", {"messages": _MSG, "stop": ""}, 400, "stop", None),
    ("stop-list-with-an-empty-string", {"messages": _MSG, "stop": ["x", ""]}, 400, "stop", None),
    ("response-format-unknown-type", {"messages": _MSG, "response_format": {"type": "yaml"}}, 400,
     "response_format", None),
    # a stop string no tokenizer can take, a schema that is no JSON Schema (the CPU backend answered both 500)
    ("stop-lone-surrogate", '{"messages": [{"role": "user", "content": "x"}], "stop": ["a", "\\udc00"]}', 400,
     "stop", None),
    ("schema-of-an-unknown-type", {"messages": _MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "objekt"}}}}}}, 400,
     "response_format", None),
]


@pytest.mark.parametrize("body, status, param, code", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_an_invalid_request_gets_a_400_with_an_openai_error_body(echo_server, body, status, param, code) -> None:
    raw = body if isinstance(body, str) else json.dumps(body)
    status_got, payload = _post(echo_server, raw)
    assert status_got == status, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code)
    assert isinstance(err["message"], str) and err["message"]
    # the server is still there and answers the next request
    assert _post(echo_server, json.dumps({"messages": _MSG, "max_tokens": 2}))[1]["choices"][0]["message"]["content"] == "one two"


def test_max_tokens_is_honoured_never_replaced(echo_server) -> None:
    code, payload = _post(echo_server, json.dumps({"messages": _MSG, "max_tokens": 1}))
    assert code == 200 and payload["choices"][0]["message"]["content"] == "one"
    code, payload = _post(echo_server, json.dumps({"messages": _MSG, "stream": False}))
    assert code == 200 and payload["choices"][0]["message"]["content"] == "one two three"


def test_a_body_over_the_limit_gets_413_before_it_is_read(echo_server) -> None:
    # only the headers are sent: the answer must come from the announced length alone, no body byte read
    # (a client that sent the whole body could meet the connection closed under it: by design)
    big = json.dumps({"messages": [{"role": "user", "content": "w " * server_mod.MAX_BODY_BYTES}]}).encode()
    host, port = echo_server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(big)))
        conn.endheaders()
        r = conn.getresponse()
        code, payload = r.status, json.loads(r.read())
    finally:
        conn.close()
    assert code == 413 and payload["error"]["param"] == "Content-Length"
    assert str(server_mod.MAX_BODY_BYTES) in payload["error"]["message"]


def _raw_exchange(srv, head: bytes, body: bytes = b"", wait_s: float = 30) -> bytes:
    """Send raw bytes (a request with a hand-written Content-Length) and read the whole answer."""
    with socket.create_connection(srv.server_address[:2], timeout=wait_s) as s:
        s.sendall(head + body)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


@pytest.mark.parametrize("length", ["abc", "-5", "1e3", "12 34"])
def test_a_malformed_content_length_gets_400_at_once(echo_server, length) -> None:
    t0 = time.monotonic()
    answer = _raw_exchange(echo_server, f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n"
                                        "\r\n".encode(), b'{"messages": []}')
    status, err = _status_and_error(answer)
    assert status == 400 and err["param"] == "Content-Length" and err["type"] == "invalid_request_error"
    assert time.monotonic() - t0 < 5


def test_a_body_shorter_than_its_content_length_gets_400_after_the_read_timeout(echo_server, monkeypatch) -> None:
    # the handler's socket timeout is read when a connection is set up: shorten it for this test
    monkeypatch.setattr(server_mod._Handler, "timeout", 1.0)
    t0 = time.monotonic()
    answer = _raw_exchange(echo_server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n",
                           b'{"messages": [')
    status, err = _status_and_error(answer)
    assert status == 400 and err["param"] == "Content-Length" and "500 bytes" in err["message"]
    assert 0.9 < time.monotonic() - t0 < 10


def test_a_client_that_closes_inside_the_body_does_not_hurt_the_server(echo_server) -> None:
    with socket.create_connection(echo_server.server_address[:2], timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{")
        s.shutdown(socket.SHUT_WR)
        answer = b"".join(iter(lambda: s.recv(65536), b""))
    status, err = _status_and_error(answer)
    assert status == 400 and "after 1 of the 500 bytes" in err["message"]
    assert _post(echo_server, json.dumps({"messages": _MSG}))[0] == 200


# -- the rest of the OpenAI error contract -----------------------------------------------------------------------
def _request(srv, method: str, path: str, body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = srv.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


@pytest.mark.parametrize("method, path, allow", [
    ("PUT", "/v1/chat/completions", "POST"), ("DELETE", "/v1/chat/completions", "POST"),
    ("PATCH", "/v1/chat/completions", "POST"), ("OPTIONS", "/v1/chat/completions", "POST"),
    ("GET", "/v1/chat/completions", "POST"), ("POST", "/v1/models", "GET"), ("DELETE", "/v1/models", "GET"),
    ("PUT", "/health", "GET"),
])
def test_a_method_the_route_does_not_take_gets_405_with_the_json_error(echo_server, method, path, allow) -> None:
    status, headers, body = _request(echo_server, method, path, json.dumps({"messages": _MSG}).encode())
    assert (status, headers["allow"], headers["content-type"]) == (405, allow, "application/json")
    assert json.loads(body) == {"error": {"message": f"Invalid method for URL ({method} {path})",
                                          "type": "invalid_request_error", "param": None, "code": None}}


def test_head_gets_405_and_no_body(echo_server) -> None:
    status, headers, body = _request(echo_server, "HEAD", "/v1/chat/completions")
    assert (status, headers["allow"], body) == (405, "POST", b"")


def test_an_unknown_route_gets_404_with_the_json_error(echo_server) -> None:
    status, _, body = _request(echo_server, "POST", "/v1/completions", json.dumps({"prompt": "x"}).encode())
    assert status == 404 and json.loads(body) == {"error": {
        "message": "Invalid URL (POST /v1/completions)", "type": "invalid_request_error", "param": None, "code": None}}


def test_an_unknown_model_gets_404_model_not_found(echo_server) -> None:
    status, payload = _post(echo_server, json.dumps({"model": "gpt-4o", "messages": _MSG}))
    assert status == 404 and payload == {"error": {
        "message": "The model `gpt-4o` does not exist or you do not have access to it.",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    # a 500 KB name is not echoed back whole (the error quoted all of it)
    status, payload = _post(echo_server, json.dumps({"model": "m" * 500_000, "messages": _MSG}))
    assert status == 404 and payload["error"]["message"] == (
        f"The model `{'m' * server_mod.MAX_QUOTED_CHARS}...` does not exist or you do not have access to it.")


def test_models_lists_exactly_the_model_served_and_that_name_is_answered(echo_server) -> None:
    status, _, body = _request(echo_server, "GET", "/v1/models")
    models = json.loads(body)
    assert status == 200 and models == {"object": "list", "data": [{
        "id": "echo", "object": "model", "created": models["data"][0]["created"], "owned_by": "memgas",
        "context_length": 4096}]}
    assert isinstance(models["data"][0]["created"], int)
    status, _, body = _request(echo_server, "GET", "/v1/models/echo")
    assert status == 200 and json.loads(body) == models["data"][0]
    status, _, body = _request(echo_server, "GET", "/v1/models/gpt-4o")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    status, payload = _post(echo_server, json.dumps({"model": "echo", "messages": _MSG}))
    assert status == 200 and payload["model"] == "echo"


def test_the_query_string_is_ignored(echo_server) -> None:
    status, _, body = _request(echo_server, "POST", "/v1/chat/completions?x=1",
                               json.dumps({"messages": _MSG, "max_tokens": 1}).encode())
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "one"
    assert _request(echo_server, "GET", "/v1/models?limit=5")[0] == 200
    assert _request(echo_server, "GET", "/health?probe=1")[0] == 200


@pytest.mark.parametrize("second", ["5", "same"])
def test_two_content_length_headers_are_refused(echo_server, second) -> None:
    """Two framings of one body (request smuggling: a proxy may use the other one): refused, connection closed."""
    body = json.dumps({"messages": _MSG}).encode()
    lengths = (len(body), len(body) if second == "same" else int(second))
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            + "".join(f"Content-Length: {n}\r\n" for n in lengths) + "\r\n").encode()
    status, err = _status_and_error(_raw_exchange(echo_server, head, body))
    assert (status, err["param"], err["type"]) == (400, "Content-Length", "invalid_request_error")


def test_a_body_the_server_does_not_read_is_never_taken_for_the_next_request(echo_server) -> None:
    """A 404 or 405 answered without reading the body closes the connection: the body's bytes (here a whole
    request of their own) are never parsed as the next request on the connection."""
    inner = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    for method, path in (("POST", "/v1/nowhere"), ("PUT", "/v1/chat/completions"), ("GET", "/health")):
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(inner)}\r\n\r\n".encode()
        answer = _raw_exchange(echo_server, head, inner)
        assert answer.count(b"HTTP/1.1 ") == 1, (method, path, answer)


@pytest.mark.parametrize("head, status", [(b"FROB /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n", 501),
                                          (b"POST /v1/chat/completions HTTP/1.1 extra\r\nHost: x\r\n\r\n", 400)])
def test_http_servers_own_errors_are_json_too(echo_server, head, status) -> None:
    """An unknown method, a malformed request line: http.server's errors, answered with the JSON error object."""
    got, err = _status_and_error(_raw_exchange(echo_server, head))
    assert got == status and set(err) == {"message", "type", "param", "code"} and err["code"] is None


def _trickle(srv, at_once: bytes, data: bytes, gap_s: float, bound_s: float) -> tuple[float, bytes]:
    """Send ``at_once``, then ``data`` one byte every ``gap_s`` (a slowloris client: each byte well within the
    per-read timeout) until the server answers or hangs up: the seconds the trickle took and the answer.
    ``bound_s`` bounds the test."""
    with socket.create_connection(srv.server_address[:2], timeout=bound_s) as s:
        s.sendall(at_once)
        s.setblocking(False)
        t0 = time.monotonic()
        answer = b""
        for byte in data:
            if time.monotonic() - t0 > bound_s:
                break
            try:
                s.send(bytes([byte]))
            except OSError:  # the server hung up
                break
            time.sleep(gap_s)
            try:
                answer = s.recv(65536)
            except BlockingIOError:
                continue
            break
        seconds = time.monotonic() - t0
        s.setblocking(True)
        answer += b"".join(iter(lambda: s.recv(65536), b""))
        return seconds, answer


@pytest.mark.parametrize("what", ["headers", "body"])
def test_a_slow_client_is_answered_once_its_request_takes_longer_than_the_deadline(echo_server, monkeypatch,
                                                                                 what) -> None:
    """Slowloris: a byte every 0.2 s never trips the per-read timeout, so the old server held the connection (and
    its thread) for as long as the client liked. Now the whole request (line, headers, body) must arrive within the
    handler's timeout (BODY_TIMEOUT_S; 1 s here) from its first byte: 408 for headers, the short body's 400 for a
    body; other clients are served meanwhile."""
    monkeypatch.setattr(server_mod._Handler, "timeout", 1.0)
    body = json.dumps({"messages": _MSG}).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    at_once, trickled = (b"", head + body) if what == "headers" else (head, body)
    box: list = []
    slow = threading.Thread(target=lambda: box.append(_trickle(echo_server, at_once, trickled, 0.2, 8)))
    slow.start()
    time.sleep(0.3)
    assert _post(echo_server, body)[0] == 200  # not blocked by the slow one
    slow.join(15)
    assert not slow.is_alive()
    seconds, answer = box[0]
    assert 0.9 < seconds < 3, (seconds, answer)
    status, err = _status_and_error(answer)
    if what == "headers":
        assert (status, err["type"], err["param"]) == (408, "invalid_request_error", None)
        assert err["message"] == "the request did not arrive within 1 s (request line, headers and body)"
    else:  # the contract of a body shorter than its Content-Length
        assert (status, err["type"], err["param"]) == (400, "invalid_request_error", "Content-Length")
        assert err["message"] == f"the body did not reach the {len(body)} bytes that Content-Length announced within 1 s"


def test_connections_past_the_cap_get_503_and_a_freed_slot_serves_again() -> None:
    """Each open connection holds a handler thread: past ``max_connections`` a new one is answered 503
    ``server_overloaded`` at once (JSON body, Retry-After) and closed; once one closes, a request is served."""
    srv = ChatServer(("127.0.0.1", 0), EchoLLM(), max_connections=2)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    held = [socket.create_connection(srv.server_address[:2], timeout=30) for _ in range(2)]
    try:
        deadline = time.monotonic() + 10
        while srv.connection_slots._value and time.monotonic() < deadline:  # both accepted, each on its thread
            time.sleep(0.01)
        answer = _raw_exchange(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, err = _status_and_error(answer)
        assert (status, err["code"], err["type"]) == (503, "server_overloaded", "server_error")
        assert b"Retry-After: 1" in answer and "2 connections open" in err["message"]
        assert srv.refused_connections == 1
        held.pop().close()
        deadline = time.monotonic() + 10
        while not srv.connection_slots._value and time.monotonic() < deadline:
            time.sleep(0.01)
        status, body = _post(srv, json.dumps({"messages": [{"role": "user", "content": "hi there"}]}))
        assert status == 200 and body["choices"][0]["message"]["content"] == "hi there"
    finally:
        for s in held:
            s.close()
        srv.shutdown()
        srv.server_close()
        t.join(10)
